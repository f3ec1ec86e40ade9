"""`dgemma doctor`: what is on this machine, and whether each Triton kernel family agrees with the torch path on
this card; what disagrees is turned off for the card (quant/kernels/verdicts.py) and the torch path runs instead.

The rule: the doctor checks and reports; it knows nothing of the command line (dgemma_cli/cli/doctor.py draws its
table and writes its JSON) and nothing of the model store. inventory.py: the machine; checks.py: the kernel families
and the CUDA-only checks; report.py: the report as a JSON-able dict, with no paths, prompts or user data.
"""
