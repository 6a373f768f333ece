"""How the trainer's weights reach a vLLM engine, and how a push is checked:

- ``weights.py``: what a push sends (the policy's tensors under their Hugging Face names, merged
  or dequantized under LoRA, their host copies for a push made later) and the weight-sync probe
  that compares the engine's log-probs with the trainer's after each push;
- ``reload.py``: ``WeightReload``, loading a served model's weights in place (the one reach-in
  into vLLM's internals; the colocated engine's push and the worker side below use it);
- ``transport.py``: the trainer's side of a sync into an engine apart from the trainer
  (``rollout.weight_transfer``: ``shm`` files or ``nccl``), through vLLM's weight-transfer
  handshake;
- ``_worker.py``: the inference side of the ``shm`` transport, imported by vLLM's workers by its
  qualified name (``worker_extension_cls``; ``transport.WORKER_EXTENSION``).
"""
