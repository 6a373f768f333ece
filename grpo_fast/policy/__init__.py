"""The policy: loading the model, the fused loss module, microbatches and checkpoints."""
