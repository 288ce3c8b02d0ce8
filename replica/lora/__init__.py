"""LoRA adapters of one engine, owned by its model runner (no heavy imports here: the
emulated engine uses ``peft`` and ``slots`` without torch).

- ``peft.py``: a PEFT folder's config and weights, read and validated.
- ``slots.py``: the registered adapters and the device slots (LRU) every engine shares.
- ``layers.py``: the wrapped fused Linears and ``LayerSlots``, their slots.
- ``batch.py``: the step's layout of adapter slots over token rows.
"""
