"""``ragen-async bench``: the benchmarks' commands (they measure and print tables; the work lives in
``ragen_async/bench/``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:

    pass

from ragen_async.cli.common import OverridesArg, cpu_list, fail, invocation, load, parse_k, print_bench, setup_logging

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (they measure and print tables; they assert nothing, "
                                                   "except `learns`, a check).")


@bench_app.command("pipeline")
def bench_pipeline_cmd(
    config: Annotated[Path, typer.Argument(help="base config")] = Path("configs/tiny/starpo_s_bandit.yaml"),
    overrides: OverridesArg = None,
    k: Annotated[list[str] | None, typer.Option(
        "--max-staleness", "--k", help="staleness bounds max_staleness, inf = unbounded (repeatable)")] = None,
    steps: Annotated[int, typer.Option(help="learner steps per run")] = 8,
    warmup: Annotated[int, typer.Option(help="steps excluded from the rates")] = 2,
    mode: Annotated[list[str] | None, typer.Option(
        help="pinned (disjoint CPU sets), unpinned (shared, same threads) and/or config (the config's own "
        "placement); default pinned and unpinned")] = None,
    consume: Annotated[list[str] | None, typer.Option(
        help="staleness.consume of the runs: arrival and/or in_order (repeatable; default the config's own); the "
        "table gives each run's share of generated groups dropped")] = None,
    out: Annotated[Path | None, typer.Option(help="append the table to this markdown file")] = None,
) -> None:
    """Throughput vs staleness k under runtime: ray, pinned (disjoint CPU sets), unpinned or as configured."""
    setup_logging()
    from ragen_async.bench.pipeline import bench_pipeline, parse_consume, parse_mode

    try:
        ks = [parse_k(x) for x in k] if k else [0, 1, 2, 4]
        modes = [parse_mode(m) for m in mode or ["pinned", "unpinned"]]
        consumes = [parse_consume(c) for c in consume] if consume else [None]
    except ValueError as e:
        fail(str(e))
    rows, table = bench_pipeline(config, overrides or [], ks, steps, warmup, modes, consumes)
    print_bench("Pipeline benchmark",
                 "pinned = rollout actors+engines and learner ranks on disjoint CPU sets; unpinned = shared, same "
                 "thread counts; config = the config's own CPU sets and thread counts.", table, out)


@bench_app.command("transport")
def bench_transport_cmd(
    groups: Annotated[int, typer.Option(help="Sokoban-sized groups per run (paper-sized: a tenth)")] = 2000,
    repeats: Annotated[int, typer.Option(help="runs of each path per shape and hop (medians, and means with "
                                                "95 % intervals from 2 runs up)")] = 3,
    pin: Annotated[bool, typer.Option(help="sender and receiver on disjoint halves of the CPUs, as on two "
                                           "machines (default: they share every core)")] = False,
    out: Annotated[Path | None, typer.Option(help="append the table to this markdown file")] = None,
) -> None:
    """Codec + ZeroMQ on loopback vs a raw send_multipart of the same bytes, two group sizes."""
    from ragen_async.bench.components import HOPS, PAPER, SOKOBAN, bench_transport, format_transport

    if groups < 10 or repeats < 1:
        raise typer.BadParameter("--groups must be >= 10 and --repeats >= 1")
    try:
        rows = bench_transport({SOKOBAN: groups, PAPER: max(1, groups // 10)}, repeats, pin=pin)
    except ValueError as e:  # --pin where it cannot pin
        fail(str(e))
    hops = "\n".join(f"- {hop}: {what}" for hop, what in HOPS.items())
    cpus = f"sender on CPUs {cpu_list(rows[0].sender_cpus)}, receiver on CPUs {cpu_list(rows[0].receiver_cpus)}"
    print_bench("Transport benchmark",
                 f"sender and receiver: two processes on loopback TCP ({cpus}); {repeats} runs per path, the paths "
                 f"alternating (a pair: a project run and the raw run after it); medians, then means with 95 % "
                 f"intervals; raw = send_multipart / recv_multipart of the same frames\n\n{hops}",
                 format_transport(rows), out)


@bench_app.command("weights")
def bench_weights_cmd(
    model: Annotated[Path, typer.Option(help="the model whose tensors are synced first")] = Path("artifacts/tiny-model"),
    repeats: Annotated[int, typer.Option(help="syncs of each kind per tensor set (the table shows medians)")] = 5,
    large: Annotated[bool, typer.Option(help="also sync Qwen2.5-0.5B-shaped bf16 tensors (about 1 GB)")] = True,
    out: Annotated[Path | None, typer.Option(help="append the table to this markdown file")] = None,
) -> None:
    """The gloo weight-sync path (publish + receive) vs a raw broadcast of the same bytes, one receiver."""
    from ragen_async.bench.components import (
        bench_weights_one,
        format_weights,
        learner_layout,
        synthetic_qwen_tensors,
        tiny_model_tensors,
    )

    if not (model / "model.safetensors").is_file():
        raise typer.BadParameter(f"{model} has no model.safetensors (run `ragen-async make-model` first)")
    sets = [(f"tiny model ({model})", tiny_model_tensors(str(model)))]
    if large:
        sets.append(("Qwen2.5-0.5B shapes, bf16 (synthetic)", synthetic_qwen_tensors()))
    rows = []
    for name, named in sets:
        # as the learner holds its weights (flatten_parameters: one buffer per dtype, sent as it is),
        # then as separate tensors (packed into buckets first, e.g. an FSDP gather's output)
        rows.append(bench_weights_one(f"{name}, flat as the learner's", learner_layout(named), repeats))
        rows.append(bench_weights_one(f"{name}, separate tensors", named, repeats))
    print_bench("Weight-sync benchmark",
                 "publisher and one receiver process, gloo over loopback; each sync timed on the publisher up to "
                 "a barrier after the receiver finished", format_weights(rows), out)


@bench_app.command("learner")
def bench_learner_cmd(
    shape: Annotated[str, typer.Option(help="qwen0.5b (random weights, bf16) or tiny (the tiny model, fp32)")] = "qwen0.5b",
    device: Annotated[str, typer.Option(help="torch device: cuda, cuda:1, cpu")] = "cuda",
    steps: Annotated[int, typer.Option(help="timed learner steps per setting (the table shows medians)")] = 5,
    warmup: Annotated[int, typer.Option(help="learner steps before the timed ones")] = 2,
    trajectories: Annotated[int, typer.Option(help="trajectories per step (a paper step's share of one rank: 8)")] = 8,
    checkpointing: Annotated[list[str] | None, typer.Option(
        help="activation checkpointing settings to time: off, on (repeatable; default both)")] = None,
    dtype: Annotated[list[str] | None, typer.Option(
        help="model.dtype settings to time (repeatable; default bfloat16); with float32 first, each row's first "
             "update is compared with float32's")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the rows as JSON here")] = None,
    out: Annotated[Path | None, typer.Option(help="append the table to this markdown file")] = None,
) -> None:
    """One learner rank's StarPO-S step at paper scale: tokens/s, peak memory and MFU, with and without
    activation checkpointing, per compute dtype (fp32 master weights in every setting)."""
    from ragen_async.bench.learner import bench_learner, format_table, rows_json

    settings = checkpointing or ["off", "on"]
    if bad := [c for c in settings if c not in ("off", "on")]:
        raise typer.BadParameter(f"--checkpointing takes off or on, not {', '.join(bad)}")
    dtypes = dtype or ["bfloat16"]
    if bad := [d for d in dtypes if d not in ("float32", "bfloat16", "float16")]:
        raise typer.BadParameter(f"--dtype takes float32, bfloat16 or float16, not {', '.join(bad)}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise typer.BadParameter(f"--device {device}: torch sees no CUDA device here (use --device cpu)")
    rows = bench_learner(shape, device, tuple(c == "on" for c in settings), steps, warmup, trajectories,
                         dtypes=tuple(dtypes),
                         on_row=lambda r: print(f"  {r.shape} on {r.device}, {r.dtype} ({r.compute_dtype} compute), "
                                                f"checkpointing {'on' if r.checkpointing else 'off'}: {r.error or f'{r.step_s:.3f} s/step'}",
                                                flush=True))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(rows_json(rows), indent=1))
    print_bench("Learner benchmark",
                 "one rank's share of a paper-scale step (configs/paper/starpo_s_sokoban.yaml: 8 trajectories of up to "
                 "4,000 tokens), synthetic token ids. FLOPs as torchtitan and verl count them (docs/benchmarks.md, "
                 "ragen_async/bench/flops.py): 6 x N without the embedding per token and pass, the attention term "
                 "12 x layers x heads x head_dim x sequence length, over every forward and backward of the step "
                 "(old values, updates); recompute (activation checkpointing) apart: MFU leaves it out, HFU counts it. Peaks in TFLOP/s: the device's dense spec "
                 "peak in the compute dtype (n/a on a CPU or a GPU not tabled) and a large matmul in the compute dtype "
                 "timed in this run", format_table(rows), out)


@bench_app.command("learns")
def bench_learns_cmd(
    overrides: Annotated[list[str] | None, typer.Argument(
        help="dotted overrides of the config, e.g. learner.micro_batch_size=32")] = None,
    model: Annotated[Path, typer.Option(help="a local checkpoint (the tiny model by default)")] = Path("artifacts/tiny-model"),
    device: Annotated[str, typer.Option(help="torch device: cpu, cuda, cuda:1")] = "cpu",
    steps: Annotated[int, typer.Option(help="learner steps per dtype")] = 40,
    dtype: Annotated[list[str] | None, typer.Option(
        help="model.dtype settings (repeatable; default float32 and bfloat16; float32 is the reference curve)")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the curves as JSON here")] = None,
    out: Annotated[Path | None, typer.Option(help="append the table to this markdown file")] = None,
) -> None:
    """Does the learner learn: a one-token bandit with a known optimum (P(target) = 1) trained with the paper
    config's StarPO-S through the real buffer and Learner, per model.dtype; prints the curves and one VERDICT line
    and, unlike the other benchmarks, exits 1 unless every dtype reaches P(target) >= 0.9 with its curve within
    0.05 of float32's on average over the steps (ragen_async/bench/learns.py)."""
    from ragen_async.bench.learns import ACTOR_LR, CRITIC_LR, bench_learns, format_curves, result_json, verdict

    dtypes = dtype or ["float32", "bfloat16"]
    if bad := [d for d in dtypes if d not in ("float32", "bfloat16", "float16")]:
        raise typer.BadParameter(f"--dtype takes float32, bfloat16 or float16, not {', '.join(bad)}")
    if not (model / "config.json").is_file():
        raise typer.BadParameter(f"{model} has no config.json (run `ragen-async make-model` first)")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise typer.BadParameter(f"--device {device}: torch sees no CUDA device here (use --device cpu)")
    result = bench_learns(str(model), device, steps, tuple(dtypes), overrides=overrides or [],
                          on_step=lambda c, s: print(f"  {c.dtype}: step {s}: P(target) {c.target_p[-1]:.3f}, "
                                                     f"reward {c.reward[-1]:.3f}", flush=True))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result_json(result), indent=1))
    ok, line = verdict(result)
    print_bench("Learner learns",
                 f"P(target token) after each step; target {result.target} (prompt {result.prompt}); "
                 f"configs/paper/starpo_s_bandit.yaml with learner.actor_lr={ACTOR_LR:g}, "
                 f"learner.critic_lr={CRITIC_LR:g}",
                 format_curves(result), out)
    print(line)
    if not ok:
        raise typer.Exit(1)


@bench_app.command("decode")
def bench_decode_cmd(
    model: Annotated[str, typer.Option(help="a local checkpoint, or qwen0.5b (its shape, random weights)")] = "qwen0.5b",
    eager: Annotated[bool, typer.Option("--eager/--graphs", help="vLLM eager mode, or CUDA graphs (GPU only)")] = False,
    requests: Annotated[int, typer.Option(help="concurrent requests")] = 64,
    max_tokens: Annotated[int, typer.Option(help="tokens sampled per request (no stop tokens)")] = 256,
    dtype: Annotated[str, typer.Option(help="engine dtype")] = "bfloat16",
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the figures as JSON here")] = None,
) -> None:
    """Decode tokens/s of one vLLM engine in one mode (eager or CUDA graphs): run once per mode, each in its own
    process (ragen_async/bench/decode.py)."""
    from ragen_async.bench.decode import bench_decode

    if not eager:
        import torch

        if not torch.cuda.is_available():
            raise typer.BadParameter("--graphs: CUDA graphs need a CUDA device, and torch sees none here (use --eager)")
    row = bench_decode(model, enforce_eager=eager, requests=requests, max_tokens=max_tokens, dtype=dtype)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(row, indent=1))
    print(f"decode ({'eager' if eager else 'CUDA graphs'}), {model}, {dtype}: {row['tokens']} tokens in "
          f"{row['seconds']:.2f} s = {row['tokens_per_s']:,.0f} tokens/s ({requests} requests x {max_tokens} tokens; "
          f"engine start {row['engine_start_s']:.0f} s)")


@bench_app.command("cluster")
def bench_cluster_cmd(
    n: Annotated[list[int] | None, typer.Option("--n", help="rollout actors (repeatable)")] = None,
    steps: Annotated[int, typer.Option(help="measured learner steps per N")] = 8,
    warmup: Annotated[int, typer.Option(help="learner steps before the measured ones")] = 3,
    groups_per_actor: Annotated[int, typer.Option(help="groups per learner step per actor")] = 4,
    concurrent_groups: Annotated[int, typer.Option(help="groups an actor plays at once")] = 4,
    k: Annotated[int, typer.Option("--max-staleness", "--k", help="staleness bound max_staleness")] = 1,
    learner_step_s: Annotated[float, typer.Option(help="the stand-in learner step's duration")] = 0.3,
    actors_per_rank: Annotated[int, typer.Option(help="rollout actors per learner rank")] = 8,
    senders: Annotated[int, typer.Option(help="Ray actor processes (hosts) the simulated actors are spread over")] = 2,
    admission: Annotated[list[str] | None, typer.Option(
        help="admission protocol (repeatable): wait (production) or poll (one try_admit per group, the earlier "
             "protocol, for comparison)")] = None,
    engine_speed: Annotated[float, typer.Option(help="stand-in engines play groups this many times faster than the "
                                                     "profile's engine (a GPU's rate)")] = 1.0,
    profile: Annotated[Path, typer.Option(help="engine profile (simprofile)")] = Path("configs/sim/sokoban_tiny_profile.json"),
    out: Annotated[Path | None, typer.Option(help="append the table to this markdown file")] = None,
) -> None:
    """The real driver loop, Ray runtime, admission gate actor, buffer and ZeroMQ transport with N simulated rollout
    actors (engine profile measured on vLLM) and a stand-in learner: groups/s vs N and where it stops scaling, and
    the gate's admissions/s, call latency and CPU."""
    from ragen_async.bench.simcluster import bench_cluster, format_cluster
    from ragen_async.bench.simprofile import load_profile

    ns = n or [2, 8, 32, 128]
    if min(ns) < 1 or steps < 1 or warmup < 1:
        raise typer.BadParameter("--n, --steps and --warmup must be >= 1")
    from ragen_async.bench.simcluster import ADMISSIONS

    modes = tuple(admission or ["wait"])
    if not set(modes) <= set(ADMISSIONS):
        raise typer.BadParameter(f"--admission must be one of {', '.join(ADMISSIONS)}, not {', '.join(modes)}")
    if engine_speed <= 0:
        raise typer.BadParameter(f"--engine-speed must be > 0, not {engine_speed}")
    if not profile.is_file():
        raise typer.BadParameter(f"{profile} does not exist (python -m ragen_async.bench.simprofile OUT)")
    summary = load_profile(profile).summary()
    rows = bench_cluster(ns, steps, warmup, groups_per_actor=groups_per_actor, concurrent_groups=concurrent_groups,
                         max_staleness=k, learner_step_s=learner_step_s, actors_per_rank=actors_per_rank,
                         senders=senders, engine_speed=engine_speed, profile=profile, admissions=modes)
    note = (f"profile {profile}: {summary['groups']} Sokoban groups of 8 recorded on vLLM (tiny model), "
            f"{summary['turns_mean']:.1f} turns and {summary['episode_tokens_mean']:.0f} tokens per episode, "
            f"{summary['reply_tokens_mean']:.1f} tokens per reply, per-token latency p50 "
            f"{summary['token_latency_ms_p50']:.1f} ms / p90 {summary['token_latency_ms_p90']:.1f} ms, "
            f"{summary['group_s_mean']:.2f} s per group; rates over the last {steps} of {steps + warmup} steps")
    print_bench("Simulated cluster", note, format_cluster(rows), out)


@bench_app.command("step")
def bench_step_cmd(
    config: Annotated[Path, typer.Argument(help="config")] = Path("configs/tiny/starpo_s_sokoban.yaml"),
    overrides: OverridesArg = None,
    steps: Annotated[int, typer.Option(help="measured learner steps")] = 10,
    warmup: Annotated[int, typer.Option(help="steps before the measured ones")] = 2,
    out: Annotated[Path | None, typer.Option(help="append the tables to this markdown file")] = None,
) -> None:
    """Where one learner step's time goes (local runtime), and the rollout's rate vs the raw engine's."""
    setup_logging()
    from ragen_async.bench.step_profile import format_profile, profile_steps

    cfg = load(config, overrides)
    profile = profile_steps(cfg, steps, warmup)
    print_bench("Step profile",
                 f"median over {profile.steps} steps after {warmup} warm-up steps", format_profile(profile), out)


@bench_app.command("rllib")
def bench_rllib_cmd(
    k: Annotated[list[int] | None, typer.Option(
        "--max-staleness", "--k", help="staleness bound max_staleness, mapped onto RLlib's knobs (repeatable)")] = None,
    seeds: Annotated[int, typer.Option(help="runs per k (RLlib seeds 0 .. N-1)")] = 1,
    budget_s: Annotated[float, typer.Option(help="training seconds per run (evaluations not counted)")] = 120.0,
    out: Annotated[Path | None, typer.Option(help="append the table to this markdown file")] = None,
    csv: Annotated[Path | None, typer.Option(
        help="write the cells (measured lag, final success and interval) here, for `report --reference`")] = None,
) -> None:
    """Classic reference: RLlib APPO with a small MLP on one-hot Sokoban, per staleness k (needs the rllib extra:
    pip install -e '.[cpu,rllib]')."""
    try:
        import ray.rllib  # noqa: F401 - the wheel ships the package; its extra brings what it imports
    except ImportError as e:
        fail(f"bench rllib needs RLlib, an optional extra: pip install -e '.[cpu,rllib]' (or '.[gpu,rllib]'): {e}")
    from ragen_async.study.rllib_ref import (
        EVAL_EPISODES,
        EVAL_SEED,
        bench_rllib,
        cells,
        format_cells,
        reference_csv,
    )

    ks = k or [0, 1, 2, 4, 8]
    if min(ks) < 0 or seeds < 1 or budget_s <= 0:
        raise typer.BadParameter("--max-staleness must be >= 0, --seeds >= 1 and --budget-s > 0")

    def progress(run) -> None:
        s = run.summary()
        print(f"k={s['k']} seed={s['seed']}: final {s['final_success']:.3f} best {s['best_success']:.3f} "
              f"sampled {s['final_success_sampled']:.3f}, {s['env_steps']} env steps in {s['train_s']:.0f} s, "
              f"lag mean {s['lag_mean']:.2f} max {s['lag_max']}", flush=True)

    results = bench_rllib(ks, seeds, budget_s, on_run=progress)
    note = (f"APPO (RLlib new API stack, torch, CPU), one EnvRunner, MLP 64x64 on the one-hot 6x6 grid; "
            f"k -> broadcast_interval = k + 1 (ragen_async/study/rllib_ref.py says how, and what it does not "
            f"bound); success over seeds {EVAL_SEED}..{EVAL_SEED + EVAL_EPISODES - 1}, one episode each; "
            f"mean ± 95 % t-interval over seeds (none with one seed); lag measured per trained timestep")
    table = cells(results)
    print_bench("RLlib APPO reference", note, format_cells(table), out)
    if csv is not None:
        csv.parent.mkdir(parents=True, exist_ok=True)
        csv.write_text(f"# {invocation()}, {time.strftime('%Y-%m-%d %H:%M')}\n" + reference_csv(table))


@bench_app.command("peer")
def bench_peer_cmd(
    env: Annotated[list[str] | None, typer.Option(help="bandit and/or sokoban (repeatable; default both)")] = None,
    k: Annotated[list[str] | None, typer.Option(
        "--max-staleness", "--k", help="our staleness bounds, inf = unbounded (repeatable; default 0, 2, inf)")] = None,
    reuse: Annotated[list[int] | None, typer.Option(
        help="TRL's steps_per_generation: optimizer steps per generation batch (repeatable; default 1, 3)")] = None,
    seeds: Annotated[int, typer.Option(help="runs per arm (seeds 0 .. N-1)")] = 3,
    steps: Annotated[int, typer.Option(help="optimizer steps per run")] = 30,
    warmup: Annotated[int, typer.Option(help="steps excluded from the rates")] = 2,
    val_episodes: Annotated[int, typer.Option(
        help="validation levels per environment after the last step (0: no validation)")] = 128,
    fixed_lag: Annotated[bool, typer.Option(help="our bounded k >= 1 as fixed lags (engines always at v - k)")] = False,
    model: Annotated[str, typer.Option(help="the model both sides train")] = "artifacts/tiny-model",
    run_root: Annotated[str, typer.Option(help="where our runs' directories go")] = "runs",
    out: Annotated[Path | None, typer.Option(help="append the tables to this markdown file")] = None,
    csv: Annotated[Path | None, typer.Option(help="write every step of every run here (CSV)")] = None,
) -> None:
    r"""TRL's GRPOTrainer beside ours on the same model, environments, levels and algorithm surface
    (ragen_async/bench/peer.py; needs the peer extra: pip install -e '.\[peer]')."""
    try:
        import trl  # noqa: F401 - only to say how to install it
    except ImportError as e:
        fail(f"bench peer needs TRL, an optional extra: pip install -e '.[peer]': {e}")
    setup_logging()
    from ragen_async.bench.peer import bench_peer, cells, curve_comparison, format_cells, parse_env, step_frame

    try:
        envs = [parse_env(e) for e in env or ["bandit", "sokoban"]]
        ks = [parse_k(x) for x in k] if k else [0, 2, None]
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    reuses = reuse or [1, 3]
    if seeds < 1 or steps < 1 or warmup < 0 or warmup >= steps or min(reuses) < 1 or val_episodes < 0:
        raise typer.BadParameter("--seeds, --steps and --reuse must be >= 1, 0 <= --warmup < --steps, "
                                 "--val-episodes >= 0")

    def progress(run) -> None:
        s = run.summary(warmup)
        print(f"{run.env} {run.side} {run.arm} seed={run.seed}: success {s['success']:.3f} val {s['val_success']:.3f}"
              f", {s['episodes_per_s']:.1f} episodes/s, step {s['step_s']:.2f} s (gen {s['gen_s']:.2f}, train "
              f"{s['train_s']:.2f}, sync {s['sync_s']:.3f}), start-up {s['startup_s']:.0f} s, age mean "
              f"{s['age_mean']:.2f} max {s['age_max']:.0f}", flush=True)

    runs = bench_peer(envs, ks, reuses, seeds, steps, model=model, val_episodes=val_episodes, fixed_lag=fixed_lag,
                      run_root=run_root, on_run=progress)
    curve, verdict = curve_comparison(runs, "bandit")
    note = (f"both sides: {model}, GRPO (group mean/std), no critic, no KL, no std filter, clip 0.2/0.28, dual clip "
            f"3 (TRL delta), token-mean (TRL bnpo), entropy bonus and learning rate of the environment's tiny config, "
            f"one optimizer pass per step; TRL plays our environments through rollout_func with its own generation; "
            f"rates over steps {warmup + 1}..{steps}; mean ± 95 % t-interval over seeds (none with one seed)")
    tables = format_cells(cells(runs, warmup))
    if curve:
        tables += f"\n\nSuccess per step on Bandit (the episodes trained on):\n\n{curve}\n\n{verdict}"
    print_bench("Peer: TRL GRPOTrainer beside ours", note, tables, out)
    if csv is not None:
        csv.parent.mkdir(parents=True, exist_ok=True)
        csv.write_text(f"# {invocation()}, {time.strftime('%Y-%m-%d %H:%M')}\n" + step_frame(runs).to_csv(index=False))
