"""Adapters: LoRA in PEFT's format (lora.py: read, check, attach unmerged to any base format, per-row slots; make and
save) and `dgemma tune`'s training (tune.py: data, the model's own block-diffusion objective, the loop, resumable
state), after mlx-lm's tuner/.

Owns: adapter files and adapter math, training.
May import the network (dgemma_cli/model.py), the checkpoint package and the bottom modules (errors, config, device);
never the engine, the store, the server or the CLI. The engine imports lora.py to attach adapters when it loads.
"""
