"""`dgemma doctor`: what is on this machine, and whether each Triton kernel family agrees with the torch path on
this card; what disagrees is turned off for the card (quant/kernels/verdicts.py) and the torch path runs instead.

inventory.py: the machine; checks.py: the kernel families (what first_use.py runs when the engine meets a card for the
first time); sizes.py: the families at a model's sizes, each call timed against its roofline bound; cuda.py: the
machinery (CUDA graphs, the copy stream, two cards, the pinned rate) on the demo model; report.py: the report as a
JSON-able dict, with no paths, prompts or user data.

Owns: the checks, the report, the first-use check at load (the verdicts themselves are quant/kernels/verdicts.py's).
On the engine's floor: imports the network, the engine, the checkpoint and placement packages and bench.py; never
the store, the server or the CLI (dgemma_cli/cli/doctor.py draws the table and writes the JSON).
"""
