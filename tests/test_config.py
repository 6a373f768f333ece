"""Config layering and validation, and the CLI's one-line errors for bad configs."""

from pathlib import Path

import pytest
from support.inprocess import one_error_line, run_main

from grpo_fast.config import PRESETS, Config, load_config, to_yaml
from grpo_fast.errors import ConfigError


def test_defaults_live_once_in_the_dataclasses():
    cfg = load_config()
    assert cfg == Config()
    # a preset only overrides: what it does not name keeps the dataclass default
    tiny = load_config("tiny")
    assert tiny.loss.clip_low == Config().loss.clip_low
    assert tiny.rollout.group_size == PRESETS["tiny"]["rollout"]["group_size"]


def test_layering_order_preset_then_files_then_overrides(tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text("train:\n  lr: 1.0e-4\nsteps: 7\n")
    b = tmp_path / "b.yaml"
    b.write_text("train:\n  lr: 2.0e-4\n")
    cfg = load_config("tiny", [str(a), str(b)], ["steps=9"])
    assert cfg.train.lr == 2e-4  # b.yaml over a.yaml
    assert cfg.steps == 9  # the override over a.yaml
    assert cfg.rollout.max_tokens == PRESETS["tiny"]["rollout"]["max_tokens"]  # the preset under both
    assert cfg.train.betas == (0.9, 0.999) and isinstance(cfg.train.betas, tuple)


def test_resolved_yaml_round_trips(tmp_path):
    cfg = load_config("tiny", overrides=["loss.beta=0.05", "loss.target_kl=0.1"])
    f = tmp_path / "config.yaml"
    f.write_text(to_yaml(cfg))
    assert load_config(config_files=[str(f)]) == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.lrr=1e-4"],
            "unknown config key 'train.lrr' in override train.lrr=... (did you mean 'train.lr'?)",
        ),
        (["rollout.tempreature=0.7"], "did you mean 'rollout.temperature'?"),
        (["steps=0"], "steps must be >= 1, got 0"),
        (["steps=-3"], "steps must be >= 1, got -3"),
        (["steps=many"], "config key 'steps'"),
        (["rollout.batch_size=100"], "rollout.batch_size=100 is not a multiple of rollout.group_size=8"),
        (["loss.type=ppo"], "loss.type='ppo' is not one of"),
        (["loss.length_norm=tokens"], "loss.length_norm='tokens' is not one of"),
        (["train.micro_batch_size=0"], "train.micro_batch_size=0 is out of range"),
        (["loss.target_kl=0.1"], "loss.target_kl needs an initial loss.beta > 0"),
        (["rollout.top_p=0"], "rollout.top_p must be in (0, 1]"),
        # the evaluation's own section (docs/evaluation.md): the old key names its new place
        (
            ["rollout.eval_temperature=0.5"],
            "'rollout.eval_temperature' in override rollout.eval_temperature=... was replaced: use eval.temperature",
        ),
        (["eval.sets=[mat500]"], "eval.sets: unknown set 'mat500' (did you mean 'math500'?)"),
        (["eval.sets=[tiny,tiny]"], "eval.sets=['tiny', 'tiny'] names the set 'tiny' twice"),
        (["eval.sets=[x=a.csv]"], "eval.sets: 'x=a.csv': 'a.csv' is not a .jsonl or .parquet file"),
        (["eval.sets=[a/b=x.jsonl]"], "the set's name 'a/b' must be letters, digits"),
        (
            ["eval.k=8", "eval.temperature=0"],
            "eval.k=8 with eval.temperature=0: greedy decoding gives the same answer 8 times",
        ),
        (
            ["eval.top_p=0.9"],
            "eval.top_p=0.9 with eval.temperature=auto (greedy at eval.k=1): greedy decoding reads no top_p",
        ),
        (
            ["eval.top_p=0.9", "eval.temperature=0"],
            "eval.top_p=0.9 with eval.temperature=0: greedy decoding reads no top_p",
        ),
        (["train.betas=[0.9,1.5]"], "train.betas must be two numbers in [0, 1)"),
        (["loss.dual_clip=0.5"], "loss.dual_clip must be > 1"),
        (["nonsense"], "override 'nonsense' is not of the form key=value"),
        (["rollout.environment=nope"], "rollout.environment: unknown tool environment 'nope'"),
        (
            ["rollout.environment=calculator", "rollout.max_response_tokens=3"],
            "rollout.max_response_tokens=3 (sampled + inserted tokens) is below rollout.max_tokens=4",
        ),
        (["rollout.max_tool_output_tokens=0"], "at least 1 (0 does not mean unlimited)"),
        (
            ["loss.mask_void_turns=true"],
            "loss.mask_void_turns acts on tool calls and needs a tool environment",
        ),
        (["data.tool_error_penalty=0.5"], "data.tool_error_penalty acts on tool calls"),
        (
            ["rollout.environment=calculator", "rollout.max_staleness=1", "rollout.is_correction=true"],
            "rollout.environment=calculator runs lockstep in this build: set rollout.max_staleness=0",
        ),
    ],
)
def test_bad_config_names_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=overrides)
    assert message in str(err.value)


def test_bad_yaml_file_names_file_and_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml line \d+ is not valid YAML"):
        load_config("tiny", [str(f)])
    g = tmp_path / "unknown.yaml"
    g.write_text("trian:\n  lr: 1\n")
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'trian' in config file .*unknown.yaml \(did you mean 'train'\?\)",
    ):
        load_config("tiny", [str(g)])
    with pytest.raises(ConfigError, match=r"missing\.yaml not found"):
        load_config("tiny", [str(tmp_path / "missing.yaml")])


def test_gpu_presets_refuse_a_cpu_machine_but_can_be_planned():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="preset 'rtx4090' needs a CUDA GPU"):
        load_config("rtx4090")
    assert load_config("rtx4090", check_device=False).train.optimizer == "adamw8bit"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--preset", "tiny", "train.lrr=1"], "did you mean 'train.lr'?"),
        (["--preset", "tiny", "steps=0"], "steps must be >= 1"),
        (["--preset", "tiny", "rollout.batch_size=12"], "not a multiple of rollout.group_size"),
        (["--preset", "nope"], "unknown preset 'nope'"),
        (
            ["--preset", "tiny", "data.train_path=/nonexistent/train.jsonl"],
            "/nonexistent/train.jsonl: file not found",
        ),
    ],
)
def test_cli_bad_config_is_one_line_exit_2_no_traceback(args, needle):
    """``grpo_fast.train.main(argv)`` in this process (tests/support/inprocess.py): exit code 2, one
    ``error:`` line, no traceback."""
    assert needle in one_error_line(run_main(args))


@pytest.mark.parametrize(
    "path", sorted(p.name for p in (Path(__file__).parent.parent / "configs").glob("*.yaml"))
)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_shipped_experiment_files_layer_on_every_preset(path, preset):
    """Every key the file sets has the file's value; every other key keeps the preset's."""
    import yaml

    from grpo_fast.config import to_dict

    file = Path(__file__).parent.parent / "configs" / path
    cfg = _flat(to_dict(load_config(preset, [str(file)], check_device=False)))
    base = _flat(to_dict(load_config(preset, check_device=False)))
    named = _flat(yaml.safe_load(file.read_text()))
    assert named and set(named) <= set(cfg), sorted(set(named) - set(cfg))
    for key, value in named.items():
        assert _same(cfg[key], value), f"{path} sets {key}={value!r}, the {preset} config has {cfg[key]!r}"
    changed = {k for k in cfg if k not in named and not _same(cfg[k], base[k])}
    assert not changed, f"{path} on {preset} changed keys it does not name: {sorted(changed)}"


@pytest.mark.parametrize("preset", list(PRESETS))
def test_fsdp_file_shards_with_plain_adamw_on_every_preset(preset):
    """configs/fsdp.yaml: train.parallelism=fsdp with plain AdamW on any preset (rtx4090's 8-bit
    AdamW has no FSDP path: without the file's optimizer line that preset is a ConfigError)."""
    file = Path(__file__).parent.parent / "configs" / "fsdp.yaml"
    cfg = load_config(preset, [str(file)], check_device=False)
    assert (cfg.train.parallelism, cfg.train.optimizer) == ("fsdp", "adamw")
    assert not cfg.train.fsdp_cpu_offload


def _flat(tree: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}} -> {"a.b": 1}``."""
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _same(got, want) -> bool:
    """Config values equal up to YAML's lists for tuples."""
    norm = lambda v: tuple(v) if isinstance(v, list | tuple) else v
    return norm(got) == norm(want)


# ----------------------------------------------------------------------------------------------
# The domain of every numeric key
# ----------------------------------------------------------------------------------------------

# Every numeric key of Config → (values it accepts, values it refuses), at the domain's edges.
# NaN and ±inf are refused for every key on top of these (meaningless for all of them).
# A key added to Config without a row here fails test_every_numeric_key_has_a_domain_row.
DOMAINS: dict[str, tuple[list[str], list[str]]] = {
    "seed": (["0", "12345", "4294967295"], ["-1", "4294967296", "1" + "0" * 400]),
    "steps": (["1", "100000000"], ["0", "-1", "100000001", "99999999999999999999999"]),
    "eval_every": (["0", "5", "100000000"], ["-1", "100000001"]),
    "full_eval_every": (["0", "5", "100000000"], ["-1", "100000001"]),
    "checkpoint_every": (["0", "5", "100000000"], ["-1", "100000001"]),
    "keep_checkpoints": (["1", "100000000"], ["0", "-1", "100000001"]),
    "data.eval_subset_size": (["0", "8", "1048576"], ["-1", "1048577"]),  # 0 with eval_every > 0: CONTEXT
    "data.reward_workers": (["auto", "1", "64"], ["0", "-1", "65", "2.5", "many"]),
    "data.overlong_buffer": (["0", "1023"], ["-1", "1024", "1048577"]),  # 1024: not below max_tokens=1024
    "data.overlong_penalty": (["0", "1.5"], ["-1"]),
    "rollout.group_size": (["2", "4"], ["1", "0", "-2", "1048577"]),  # 1: loss.advantage=group needs a group
    "rollout.batch_size": (
        ["8", "1048576"],
        ["0", "-8", "12", "2097152", "99999999999999999992"],
    ),  # 12: not a multiple of group_size=8
    "rollout.temperature": (["0.1", "2.0"], ["0", "-1"]),
    "rollout.top_p": (["1.0", "0.5"], ["0", "-0.5", "1.5"]),
    "rollout.top_k": (["0", "20", "1048576"], ["-1", "2.5", "1048577"]),
    "rollout.max_tokens": (["4", "1048576"], ["0", "-1", "3", "1048577"]),  # 3: below min_tokens=4
    "rollout.min_tokens": (["0", "4"], ["-1", "2000", "1048577"]),  # 2000: above max_tokens=1024
    "rollout.max_prompt_tokens": (["1", "1048576"], ["0", "-1", "1048577"]),
    "rollout.generation_batch_size": (["1", "1048576"], ["0", "-1", "1048577"]),
    "rollout.gpu_memory_utilization": (["auto", "0.5"], ["0", "-0.5", "1.5"]),
    "rollout.sleep_level": (["0", "2"], ["-1", "3"]),
    "rollout.weight_sync_tolerance": (["auto", "0", "0.05"], ["-0.1"]),
    "rollout.is_cap": (["1.5"], ["1", "0", "-2"]),
    "rollout.max_sampling_rounds": (["1", "5", "10000"], ["0", "-1", "10001"]),
    "rollout.curriculum_start": (["0.25", "1"], ["0", "-0.5", "1.5"]),
    "rollout.curriculum_steps": (["null", "1", "250", "100000000"], ["0", "-1", "2.5", "100000001"]),
    "rollout.min_group_size": (["2", "16"], ["1", "0", "17", "1048577"]),  # 17: above max_group_size=16
    "rollout.max_group_size": (
        ["2", "64", "1048576"],
        ["1", "0", "-1", "1048577"],
    ),  # 1: below min_group_size=2
    # the tool caps: 0 is refused (it does not mean unlimited)
    "rollout.max_tool_calls": (["0", "1", "4", "1024"], ["-1", "2.5", "1025"]),  # 0: zero calls
    "rollout.max_turns": (["auto", "1", "1025"], ["0", "-1", "1026"]),
    "rollout.max_tool_output_tokens": (["1", "256", "1048576"], ["0", "-1", "1048577"]),
    "rollout.max_response_tokens": (["auto", "1024", "1048576"], ["0", "-1", "1048577"]),
    "rollout.tool_timeout_s": (["0.5", "10", "3600"], ["0", "-1", "3601"]),
    "rollout.tool_workers": (["auto", "1", "256"], ["0", "-1", "2.5", "257"]),
    "data.tool_error_penalty": (["0", "0.5"], ["-0.1"]),  # above 0 needs an environment: CONTEXT
    "rollout.max_staleness": (["0", "1", "8"], ["-1", "9", "1.5"]),  # > 0 needs a correction: CONTEXT
    "rollout.worker_threads": (["auto", "1", "1024"], ["0", "-1", "1.5", "1025"]),
    "rollout.num_engines": (["1", "64"], ["0", "1.5", "65"]),
    "rollout.min_engines": (["1", "64"], ["0", "1.5", "65"]),
    "rollout.start_timeout": (["0.5", "900"], ["0", "-1"]),
    "rollout.request_timeout": (["0.5", "3600"], ["0", "-1"]),
    "rollout.sync_timeout": (["0.5", "600"], ["0", "-1"]),
    "train.lr": (["0", "1e-5"], ["-1e-5"]),
    "train.betas": (["[0.0,0.5]"], ["[-0.1,0.9]", "[0.9,1.0]", "[0.9]"]),
    "train.weight_decay": (["0", "0.1"], ["-0.1"]),
    "train.warmup_steps": (["0", "10", "100000000"], ["-1", "100000001"]),
    "train.min_lr_ratio": (["0", "1"], ["-0.1", "1.5"]),
    "train.grad_clip": (["0", "1.0"], ["-1"]),
    "train.micro_batch_size": (["auto", "1", "1048576"], ["0", "-2", "1.5", "1048577"]),
    "train.epochs_per_rollout_batch": (["1", "2", "1000"], ["0", "-1", "1001"]),
    "train.max_nonfinite_steps": (["1", "10", "100000000"], ["0", "-1", "100000001"]),
    "train.sequence_parallel": (["1", "2", "8", "1024"], ["0", "-1", "1.5", "1025"]),
    "loss.clip_low": (["0", "0.2"], ["-0.1", "1", "2"]),
    "loss.clip_high": (["0", "0.3"], ["-0.1"]),
    "loss.dual_clip": (["null", "3"], ["1", "0", "-3"]),
    "loss.delta": (["null", "4"], ["1", "0", "-4"]),
    "loss.top_entropy_quantile": (["1", "0.2"], ["0", "-0.5", "1.5"]),
    "loss.beta": (["0", "0.1"], ["-0.1"]),
    "loss.target_kl": (["null"], ["0", "-0.1"]),  # a value needs loss.beta > 0: see CONTEXT
    "loss.kl_early_stop": (["null", "0.3"], ["0", "-0.3"]),
    "loss.entropy_target": (["null", "0.5"], ["0", "-0.5"]),
    "loss.entropy_coef_max": (["0", "0.1"], ["-0.1"]),
    "loss.entropy_coef_step": (["0.005"], ["0", "-0.005"]),
    "loss.entropy_coef": (["0", "0.01", "-0.01"], []),  # negative: an entropy penalty, allowed
    "loss.advantage_eps": (["0", "1e-6"], ["-1e-6"]),
    "loss.gamma": (["0", "0.99", "1"], ["-0.1", "1.5"]),  # != 1: with loss.advantage=reinforce_pp (CONTEXT)
    "eval.k": (["1", "8", "1024"], ["0", "-1", "2.5", "1025"]),  # above 1 with a temperature (CONTEXT)
    "eval.temperature": (["0", "0.7", "auto"], ["-0.1"]),
    "eval.top_p": (["1.0", "0.95"], ["0", "-0.5", "1.5"]),  # below 1 with a temperature (CONTEXT)
    "eval.max_tokens": (["auto", "1", "1048576"], ["0", "-1", "2.5", "1048577"]),
    "distill.coef": (["0.5", "1", "10"], ["0", "-1"]),  # with distill.teacher (CONTEXT)
    "distill.reward_weight": (["0", "1", "2"], ["-1"]),
    # critic.*: with loss.advantage=gae (CONTEXT)
    "critic.lr": (["null", "1e-5", "1"], ["0", "-1e-5"]),
    "critic.value_clip": (["null", "0.2", "10"], ["0", "-0.2"]),
    "critic.trunk_coef": (["0", "0.5", "1"], ["-0.1", "1.5"]),
    "critic.warmup_steps": (["0", "5", "100000000"], ["-1", "100000001"]),
    "critic.lam": (["0", "0.95", "1"], ["-0.1", "1.5"]),
    "critic.policy_lam": (["0", "0.95", "1"], ["-0.1", "1.5"]),
    "critic.lam_alpha": (["null", "0.05", "10"], ["0", "-0.05"]),
    "loss.sapo_tau_pos": (["1.0", "0.5"], ["0", "-1"]),
    "loss.sapo_tau_neg": (["1.05", "2"], ["0", "-1"]),
    "loss.chunk_size": (["auto", "1", "1048576"], ["0", "-1", "2.5", "1048577"]),
    "sft.steps": (["0", "10", "100000000"], ["-1", "100000001"]),
    "sft.lr": (["0", "1e-3"], ["-1e-3"]),
    "sft.batch_size": (["1", "1048576"], ["0", "-1", "1048577"]),
    "sft.target_accuracy": (["null", "1", "0.5"], ["0", "-0.5", "1.5"]),
    "sft.check_every": (["1", "100000000"], ["0", "-1", "100000001"]),
    "sft.check_size": (["1", "1048576"], ["0", "-1", "1048577"]),
    "sft.mix_coef": (["0", "0.1"], ["-0.1"]),
    "threads.intra_op": (["auto", "1", "1024"], ["0", "-1", "1.5", "1025", "many"]),
    "model.lora.r": (["0", "8", "65536"], ["-1", "65537"]),
    "model.lora.alpha": (["0.5", "32"], ["0", "-1"]),
    "model.lora.dropout": (["0", "0.5"], ["-0.1", "1"]),
    "model.lora.lr_scale": (["1", "10"], ["0", "-1"]),
    "model.lora.target_modules": (["all-linear", "[q_proj,v_proj]"], ["7", "[]", "all"]),
    "logging.sample_every": (["0", "10", "100000000"], ["-1", "100000001"]),
    "logging.samples_per_dump": (["0", "16", "1048576"], ["-1", "1048577"]),
}
# Other keys a value needs to be valid in combination.
CONTEXT = {
    "loss.target_kl": ["loss.beta=0.1"],
    "eval.k": ["eval.temperature=0.6"],
    "eval.top_p": ["eval.temperature=0.6"],
    "data.eval_subset_size": ["eval_every=0"],
    "data.tool_error_penalty": ["rollout.environment=calculator"],
    "rollout.max_staleness": ["rollout.old_logprobs=sampler"],
    "loss.gamma": ["loss.advantage=reinforce_pp"],
    "distill.coef": ["distill.teacher=/some/teacher"],
    "distill.reward_weight": ["distill.teacher=/some/teacher"],
    "critic.lr": ["loss.advantage=gae"],
    "critic.value_clip": ["loss.advantage=gae"],
    "critic.trunk_coef": ["loss.advantage=gae"],
    "critic.warmup_steps": ["loss.advantage=gae"],
    "critic.lam": ["loss.advantage=gae"],
    "critic.policy_lam": ["loss.advantage=gae"],
    "critic.lam_alpha": ["loss.advantage=gae"],
    "rollout.worker_threads": ["rollout.placement=process"],
    "rollout.num_engines": ["rollout.placement=process", "rollout.min_engines=1"],
    "rollout.min_engines": ["rollout.placement=process", "rollout.num_engines=64"],
}
NUMERIC_TYPES = {"int", "float", "float | None", "int | None", "Any", "tuple[float, float]"}


def _numeric_keys(cls: type = Config, prefix: str = "") -> set[str]:
    """Every numeric leaf of Config, by its annotation (so None-defaulted keys count too)."""
    import dataclasses

    from grpo_fast.config import _is_section

    keys = set()
    for f in dataclasses.fields(cls):
        if _is_section(f):
            keys |= _numeric_keys(type(f.default_factory()), f"{prefix}{f.name}.")
        elif f.type in NUMERIC_TYPES:
            keys.add(f"{prefix}{f.name}")
    return keys


def test_every_numeric_key_has_a_domain_row():
    assert _numeric_keys() == set(DOMAINS), (
        f"missing rows: {sorted(_numeric_keys() - set(DOMAINS))}; stale rows: {sorted(set(DOMAINS) - _numeric_keys())}"
    )


def _cases(kind: str) -> list:
    out = []
    for key, (good, bad) in DOMAINS.items():
        values = good if kind == "good" else bad
        if kind == "bad":
            if key == "train.betas":
                values = [*values, "[0.9,nan]", "[inf,0.9]"]
            else:
                values = [*values, "nan", "inf", "-inf"]
        out.extend(pytest.param(key, v, id=f"{key}={v}") for v in values)
    return out


@pytest.mark.parametrize(("key", "value"), _cases("good"))
def test_numeric_key_accepts_its_domain(key, value):
    """The value is accepted and is what the config holds afterwards (not clamped, not dropped)."""
    cfg = load_config(overrides=[*CONTEXT.get(key, []), f"{key}={value}"], check_device=False)
    got = cfg
    for part in key.split("."):
        got = getattr(got, part)
    assert _same(got, _literal(value)), f"{key}={value} gave {got!r}"


def _literal(text: str):
    """An override's value as the config should hold it: null, a number, a list, or the word."""
    if text == "null":
        return None
    if text.startswith("["):
        return [_literal(x) for x in text.strip("[]").split(",")]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


@pytest.mark.parametrize(("key", "value"), _cases("bad"))
def test_numeric_key_refuses_outside_its_domain_naming_it(key, value):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[*CONTEXT.get(key, []), f"{key}={value}"], check_device=False)
    msg = str(err.value)
    assert key in msg and "\n" not in msg, msg


def _integer_keys(cls: type = Config, prefix: str = "") -> dict[str, object]:
    """Every integer leaf of Config (by its annotation, or an integer domain under ``Any``) → its domain."""
    import dataclasses

    from grpo_fast.config import _is_section

    keys = {}
    for f in dataclasses.fields(cls):
        domain = f.metadata.get("domain")
        if _is_section(f):
            keys |= _integer_keys(type(f.default_factory()), f"{prefix}{f.name}.")
        elif f.type in ("int", "int | None") or getattr(domain, "integer", False):
            keys[f"{prefix}{f.name}"] = domain
    return keys


def test_every_integer_key_has_a_bound_a_run_can_reach_and_says_why():
    """An absurd value (steps=10^23, rollout.batch_size=10^20) is refused in one line naming the key
    and the bound, instead of a plan of 10^19 hours or a run that never starts: every integer key
    has a finite upper bound with its reason (or a list of choices)."""
    from grpo_fast.domains import OneOf, Range

    keys = _integer_keys()
    assert len(keys) > 25 and "steps" in keys and "train.micro_batch_size" in keys
    for key, domain in keys.items():
        if isinstance(domain, OneOf):
            assert all(isinstance(c, int) for c in domain.choices), key
            continue
        assert isinstance(domain, Range) and domain.integer, f"{key}: no integer domain"
        assert domain.hi is not None and domain.hi <= 2**32, f"{key}: no bound a run can reach"
        assert domain.hi_why.startswith(": ") and len(domain.hi_why) > 20, f"{key}: the bound has no reason"


def test_an_absurd_integer_names_the_key_the_bound_and_why():
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=["steps=99999999999999999999999"])
    assert str(err.value).startswith("steps must be <= 100000000, got 99999999999999999999999: 10^8 steps")
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=["rollout.batch_size=99999999999999999992"])
    assert str(err.value).startswith("rollout.batch_size must be <= 1048576, got 99999999999999999992: 2^20")


def test_group_size_one_is_refused_with_the_reason():
    """Every estimator with a group baseline refuses a group of one; REINFORCE++ takes it."""
    for est in ("group", "rloo", "reinforce_pp_baseline"):
        with pytest.raises(
            ConfigError,
            match=rf"rollout.group_size=1 with loss.advantage={est}: its advantage is a response's",
        ):
            load_config("tiny", overrides=["rollout.group_size=1", f"loss.advantage={est}"])
    assert (
        load_config(
            "tiny", overrides=["rollout.group_size=1", "loss.advantage=reinforce_pp"]
        ).rollout.group_size
        == 1
    )
    with pytest.raises(ConfigError, match=r"rollout.dynamic_sampling=true with rollout.group_size=1"):
        load_config(
            "tiny",
            overrides=[
                "rollout.group_size=1",
                "loss.advantage=reinforce_pp",
                "rollout.dynamic_sampling=true",
            ],
        )


def test_mixed_precision_no_on_the_command_line():
    """YAML reads a bare ``no`` as false; the override still means no autocast."""
    assert load_config("tiny", overrides=["train.mixed_precision=no"]).train.mixed_precision == "no"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.reward=[]"], "data.reward must be a reward name or a non-empty list of names, got []"),
        (["data.reward=[r1_zero,r1_zero]"], "data.reward lists 'r1_zero' twice"),
        (["data.reward_weights=[1.0]"], "data.reward_weights needs data.reward to be a list"),
        (
            ["data.reward=[r1_zero,gsm8k]", "data.reward_weights=[1.0]"],
            "data.reward_weights has 1 weights for the 2 rewards of data.reward",
        ),
        (
            ["data.reward=[r1_zero]", "data.reward_weights=[nan]"],
            "data.reward_weights[0]=nan is not a finite number",
        ),
        (
            ["rollout.difficulty_filter=[0.9,0.1]"],
            "rollout.difficulty_filter must be [lo, hi] with 0 <= lo <= hi <= 1",
        ),
        (["rollout.difficulty_filter=[0.1]"], "rollout.difficulty_filter must be [lo, hi]"),
        (["rollout.difficulty_filter=[-0.1,0.5]"], "rollout.difficulty_filter must be [lo, hi]"),
        (
            ["rollout.curriculum=hard_first"],
            "rollout.curriculum='hard_first' is not one of: none, easy_first",
        ),
        (
            ["rollout.adaptive_group_size=true", "rollout.group_size=32", "rollout.batch_size=256"],
            "rollout.adaptive_group_size=true needs rollout.min_group_size=2 <= rollout.group_size=32 <= "
            "rollout.max_group_size=16",
        ),
        (["data.overlong_buffer=4"], "data.overlong_buffer=4 must be below rollout.max_tokens=4"),
    ],
)
def test_issue13_options_refuse_bad_values_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_issue13_options_accept_their_values():
    cfg = load_config(
        "tiny",
        overrides=[
            "data.reward=[auto,gsm8k]",
            "data.reward_weights=[1.0,0.5]",
            "rollout.difficulty_filter=[0.0,0.9]",
            "rollout.curriculum=easy_first",
            "rollout.adaptive_group_size=true",
            "rollout.dynamic_sampling=true",
            "data.overlong_buffer=2",
            "sft.mix_coef=0.1",
        ],
    )
    assert cfg.data.reward == ["auto", "gsm8k"] and cfg.data.reward_weights == [1.0, 0.5]
    assert cfg.rollout.difficulty_filter == [0.0, 0.9]
    # off by default: the runs of before
    d = Config()
    assert (d.rollout.dynamic_sampling, d.rollout.adaptive_group_size, d.rollout.curriculum) == (
        False,
        False,
        "none",
    )
    assert (d.data.overlong_buffer, d.sft.mix_coef, d.rollout.difficulty_filter, d.data.reward_weights) == (
        0,
        0.0,
        None,
        None,
    )


def test_the_gpu_presets_the_machine_check_knows_are_presets():
    from grpo_fast.config import PRESETS
    from grpo_fast.config_checks import GPU_PRESETS

    assert set(GPU_PRESETS) <= set(PRESETS)
    assert all(PRESETS[name].get("device", "cuda") != "cpu" for name in GPU_PRESETS)
