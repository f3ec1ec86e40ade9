"""Answers held to a structure: JSON Schemas, regular expressions and grammars checked and compiled
(structure.py, no torch), the search over the canvas that holds a decode to them (constrain.py), and the compile's own
process with its time and memory budget (worker.py).

Owns: structures, from the request's text to the token automaton the sampler consults.
May import only the bottom modules (errors, config); never the network, the engine, the server or the CLI, which all
import it (the chat format's tool calls too).
"""
