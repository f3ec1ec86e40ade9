"""Placement: what lives where when the model is larger than the card. cards.py (the cards dgemma plans for: memory,
bandwidth, host link, from their vendors' pages; sizes as people write them), plan.py (the planner: per card the
fixed part, each layer's experts resident or streamed, layers split over cards; refusals in one line), streaming.py
(at run time: the streamed layers' experts in host memory, copied into two layer buffers before each use).

Owns: the placement plan and the streamed experts' buffers and copies.
May import the network, the checkpoint package (sizes per format) and the bottom modules; never the store, the
server or the CLI. cards.py and plan.py import no torch (`dgemma plan` answers in a fraction of a second); the engine
imports this package when it loads.
"""
