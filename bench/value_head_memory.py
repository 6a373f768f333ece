"""Peak resident-set growth of one optimization step (fused lm_head + loss, AdamW) on a random Qwen2
of the benchmarks' shape (``bench/peers/workloads.py``'s ``wide_config`` at 4 layers: D 512,
MLP 1,536, V 32,768, tied; 8 prompts of 128 tokens x 8 responses
of 64, microbatch 8), with and without the value head of ``loss.advantage=gae``; each measurement
in a fresh process (``grpo_fast.obs.memory.peak_rss_growth``), alternating, 2 rounds.

    OMP_NUM_THREADS=1 python -m bench.value_head_memory

docs/loss.md ("The value model") has the figures.
"""

import torch
from transformers import Qwen2ForCausalLM

from bench.peers.workloads import wide_config
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.config import load_config
from grpo_fast.loop.optim import build_optimizer
from grpo_fast.loop.optimization import optimize_on_rollout
from grpo_fast.loop.state import Trainer
from grpo_fast.obs.memory import peak_rss_growth
from grpo_fast.policy.batch import loss_trajectories, make_microbatches
from grpo_fast.policy.loss import PolicyLoss
from grpo_fast.policy.value import ValueHead
from grpo_fast.rollout import Rollout


def build(value: bool):
    torch.manual_seed(0)
    cfg_m = wide_config(layers=4)  # the benchmarks' random Qwen2 (bench/peers/workloads.py)
    model = Qwen2ForCausalLM(cfg_m)
    cfg = load_config(
        "tiny",
        overrides=["train.micro_batch_size=8", "loss.kernel_backend=torch_chunked"]
        + (["loss.advantage=gae"] if value else []),
    )
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 32000, (128,), generator=g).tolist() for _ in range(8)]
    responses = [torch.randint(10, 32000, (64,), generator=g).tolist() for _ in range(64)]
    seqs = loss_trajectories(
        Rollout(prompts, responses),
        advantages=torch.randn(64, generator=g),
        length_norm="sequence_mean",
        max_length=64,
    )
    head, vparams = None, []
    policy = PolicyLoss(model, autocast=None, backend="torch_chunked")
    if value:
        head = ValueHead(512)
        policy.attach_value_head(head, 0.0, 0.2)
        vparams = list(head.parameters())
        for t in seqs:
            t.token_returns, t.token_values = (
                torch.randn(t.num_sampled, generator=g),
                torch.zeros(t.num_sampled),
            )
    mbs = make_microbatches(seqs, 8, 0, packing=False)
    params = list(model.parameters())
    opt = build_optimizer(cfg, params, vparams)
    trainer = Trainer(policy, opt, params + vparams, cfg, value_head=head)
    return lambda: optimize_on_rollout(trainer, mbs, options=LossOptions(), temperature=1.0)


if __name__ == "__main__":
    for r in range(2):
        for value in (False, True):
            b = peak_rss_growth(build, value)
            print(f"round {r + 1} value_head={value}: peak RSS growth {b / 2**20:.1f} MiB", flush=True)
