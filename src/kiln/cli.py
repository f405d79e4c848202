"""The ``kiln`` command: parse arguments, build the Config, call one function per subcommand.

Bad input (config, data, paths) exits with status 2 and one line per problem on stderr; a run
that runs out of device memory beyond what its out-of-memory ladder can absorb exits with 3, one
whose steps stay non-finite after the guard's rollbacks with 4; every rank of a job the hang
watchdog finds stuck exits with 5 (``kiln.distributed.watchdog.HANG_EXIT``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

USAGE_ERROR = 2
# The device ran out of memory: the run saved what it could and says how it will go on.
OUT_OF_MEMORY = 3
# Non-finite steps kept coming back after the non-finite guard's rollbacks.
DIVERGED = 4


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="TOML config file (defaults apply to anything it leaves out)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set train.lr=3e-4 (repeatable)",
    )


@dataclass(frozen=True)
class Command:
    """One subcommand of ``kiln``: its name and help line, the function that adds its arguments,
    the function that runs it (returning the exit status) and, optionally, its longer description."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None


def _load(args, *extra: str):
    """The Config of the command's file and --set overrides (then ``extra`` ones, the command's
    own), its [model] checked by its family."""
    from kiln.config import load_config
    from kiln.models.family import check_model_config

    cfg = load_config(args.config, [*args.overrides, *extra])
    check_model_config(cfg)
    return cfg


def _train_args(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    p.add_argument(
        "--resume",
        metavar="auto|never|PATH",
        help="resume from the newest complete checkpoint (auto, the default), start fresh "
        "(never), or from a checkpoint directory; same as --set checkpoint.resume=...",
    )


def cmd_train(args) -> int:
    from kiln.train.trainer import train

    result = train(_load(args, *([f"checkpoint.resume={args.resume}"] if args.resume else [])))
    return 0 if not result.interrupted else 130


def cmd_prepare(args) -> int:
    from kiln.distributed.world import init_world
    from kiln.train.jobs import job_for

    # The job's own data config (a Hugging Face model's text is tokenized by its tokenizer):
    # what is cached here is what `kiln train` reads.
    job = job_for(_load(args))
    # Under kiln launch every rank tokenizes its share of the files.
    world = init_world("cpu", job.cfg.parallel)
    sources = job.prepare_data(world, world.is_main)
    if not world.is_main:
        return 0
    if not sources:
        print(f"kiln: {job.cfg.run.job} runs read their records into memory as training starts; nothing to prepare")
        return 0
    for name, prepared in sources.items():
        m = prepared.manifest
        state = "tokenized" if prepared.tokenized else "already prepared (nothing to do)"
        print(f"kiln: {state}{f' data.mix source {name!r}' if name else ''}: {prepared.dir}")
        for split, s in m["splits"].items():
            print(f"  {split}: {s['documents']:,} documents, {s['tokens']:,} tokens, {s['bytes']:,} bytes")
        print(f"  vocab {prepared.vocab_size}, corpus fingerprint {m['corpus_fingerprint'][:16]}")
    return 0


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run directory, checkpoint directory or kiln export directory")
    p.add_argument(
        "--data", help="evaluate on every token of every document of this source instead of the run's val split"
    )
    p.add_argument(
        "--tasks",
        help="lm-evaluation-harness tasks to score, comma-separated (needs kiln[eval]); results in RUN_DIR/eval/",
    )
    p.add_argument("--include-path", help="a directory of lm-eval task YAML files (beside lm-eval's own tasks)")
    p.add_argument("--num-fewshot", type=int, help="examples in each prompt (default: each task's own)")
    p.add_argument("--limit", type=float, help="at most this many documents of each task (a fraction if below 1)")
    p.add_argument("--log-samples", action="store_true", help="also write each task's scored samples")
    p.add_argument("--checkpoint", help="checkpoint directory (default: the newest complete one)")
    p.add_argument(
        "--max-batches", type=int, help="at most this many batches (default: 100 of the val split; all of --data)"
    )
    p.add_argument(
        "--batch-size", type=int, help="sequences per batch (default: the run's micro-batch; 8 for one of auto)"
    )
    p.add_argument("--device", default="auto")
    _trust_argument(p)


def cmd_eval(args) -> int:
    from kiln.train.run import load_run

    if args.tasks:
        return _eval_tasks(args)
    run = load_run(args.run_dir, args.checkpoint, args.device, args.trust_checkpoint)
    metrics = run.job.evaluate_saved(run, source=args.data, max_batches=args.max_batches, batch_size=args.batch_size)
    print(json.dumps(metrics))
    return 0


def _eval_tasks(args) -> int:
    from kiln.harness import check_tasks, run_tasks, table, task_manager, write_results
    from kiln.train.run import load_run

    names = [name.strip() for name in args.tasks.split(",") if name.strip()]
    manager = task_manager(args.include_path, names)
    check_tasks(names, manager)
    from kiln.harness.model import KilnLM

    run = load_run(args.run_dir, args.checkpoint, args.device, args.trust_checkpoint)
    context = run.family.context_length(run.args) or run.cfg.data.seq_len
    lm = KilnLM(run.model, run.family, run.tokenizer, context, batch_size=args.batch_size or 8)
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    results = run_tasks(lm, names, manager, num_fewshot=args.num_fewshot, limit=limit, log_samples=args.log_samples)
    if results is None:  # a process of a launched job other than the first: rank 0 reports
        return 0
    written = write_results(results, run.directory / "eval")
    print(table(results))
    print(f"kiln: wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return 0


def _trust_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="load a run whose config names a plug-in model family, a module that loading it imports and "
        "runs (docs/trust.md); only for runs from a source you trust",
    )


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run directory")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=50, help="keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", help="checkpoint directory (default: the newest complete one)")
    p.add_argument("--device", default="auto")
    _trust_argument(p)


def cmd_generate(args) -> int:
    from kiln.train.jobs.lm import sample_text
    from kiln.train.run import load_run

    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        print(
            "kiln: error: need --max-new-tokens >= 1, --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0",
            file=sys.stderr,
        )
        return USAGE_ERROR
    run = load_run(args.run_dir, args.checkpoint, args.device, args.trust_checkpoint)
    for i in range(args.num_samples):
        text = sample_text(
            run.family,
            run.model,
            run.tokenizer,
            args.prompt,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k or None,
            top_p=args.top_p if args.top_p < 1 else None,
            seed=args.seed + i,
        )
        if text is None:
            print(f"kiln: error: model family {run.cfg.model.family} cannot generate text", file=sys.stderr)
            return USAGE_ERROR
        print(text if args.num_samples == 1 else f"--- sample {i + 1} ---\n{text}")
    return 0


def _config_args(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    p.add_argument(
        "--reference",
        action="store_true",
        help="print every key with its default and meaning (Markdown, as in docs/config.md)",
    )


def cmd_config(args) -> int:
    from kiln.config import config_reference

    if args.reference:
        print(config_reference(), end="")
        return 0
    print(_load(args).to_toml(), end="")
    return 0


def _no_args(p: argparse.ArgumentParser) -> None:
    """A command without arguments."""


def cmd_presets(args) -> int:
    from kiln.config import ModelConfig
    from kiln.models.gpt import PRESETS, build_gpt_config, param_count

    # Experts: routed x picked a token (+ shared); active: the parameters one token goes through.
    print(
        f"{'preset':<14}{'layers':>7}{'d_model':>8}{'heads':>6}{'kv':>5}{'experts':>10}"
        f"{'params (vocab 32k)':>20}{'active':>17}"
    )
    for name in PRESETS:
        c = build_gpt_config(ModelConfig(preset=name), vocab_size=32000, max_seq_len=0)
        experts = f"{c.n_experts}x{c.experts_per_token}+{c.n_shared_experts}" if c.n_experts else "-"
        print(
            f"{name:<14}{c.n_layer:>7}{c.d_model:>8}{c.n_head:>6}{c.n_kv_head:>5}{experts:>10}"
            f"{param_count(c):>20,}{param_count(c, active=True):>17,}"
        )
    return 0


def _plan_args(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    p.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="memory per device: 80GB, 80GiB, 24G, 512MB or bytes (default: this machine's GPU, else its RAM)",
    )
    p.add_argument("--gpu", metavar="NAME", help="plan for this GPU, e.g. h100, a100 (default: this machine's GPU)")
    p.add_argument(
        "--world-size", type=int, metavar="N", help="GPUs (processes) in all (default: nodes x GPUs per node, or 1)"
    )
    p.add_argument("--nodes", type=int, metavar="N", help="nodes (default: as many as the world size fills)")
    p.add_argument(
        "--gpus-per-node", type=int, metavar="N", help="GPUs per node, joined by NVLink (default 8; one node if fewer)"
    )
    p.add_argument(
        "--bandwidth",
        action="append",
        metavar="LINK=GB/s,...",
        help="effective bandwidth per GPU and direction, in GB/s, of nvlink (inside a node), network (between "
        "nodes) or pcie (host copies), e.g. nvlink=360,network=40 (default: 80%% of the GPU's NVLink, of "
        "a 400 Gb/s NIC per GPU; pcie 25)",
    )
    p.add_argument(
        "--compute-efficiency",
        type=float,
        metavar="F",
        help="fraction of the dense bf16 peak the kernels reach while nothing waits for communication "
        "(default 0.40; 0.60 on A100)",
    )
    p.add_argument("--top", type=int, default=3, metavar="N", help="how many setups to list (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object (bytes, seconds) instead of the table")


def cmd_plan(args) -> int:
    from kiln.plan import format_plan, make_plan, plan_json

    plan = make_plan(
        _load(args),
        world_size=args.world_size,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        device_memory=args.device_memory,
        gpu=args.gpu,
        bandwidth=args.bandwidth,
        compute_efficiency=args.compute_efficiency,
        top=args.top,
    )
    print(json.dumps(plan_json(plan), indent=2) if args.json else format_plan(plan))
    return 0


def _profile_args(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    p.add_argument(
        "--steps", default="5:8", metavar="START:END", help="steps to profile, 1-based, inclusive (default 5:8)"
    )
    p.add_argument("--out", help="where the trace and breakdown.json go (default: RUN_DIR/profile)")


def cmd_profile(args) -> int:
    from kiln.train.profile_steps import profile_steps

    profile_steps(_load(args), args.steps, args.out)
    return 0


def _doctor_args(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def cmd_doctor(args) -> int:
    from kiln.doctor import doctor_command

    return doctor_command(args.config, args.overrides, args.json)


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directory; several: a comparison table")
    p.add_argument(
        "--out",
        help="figure path (.png, .svg or .pdf; default RUN_DIR/report.png); the summary goes beside it. "
        "With several runs: the comparison table as markdown (.md)",
    )
    p.add_argument("--json", action="store_true", help="print the summary (or the comparison) as one JSON object")


def cmd_report(args) -> int:
    from kiln.observe.report import report_command

    return report_command(args.run_dirs, args.out, args.json)


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR|CHECKPOINT", help="run directory or checkpoint directory")
    p.add_argument("--format", required=True, choices=["hf", "safetensors", "pt2", "onnx"])
    p.add_argument("--out", required=True, help="output directory (written whole, or not at all)")
    p.add_argument(
        "--quantize",
        choices=["int8", "int8-static"],
        help="int8: int8 weights and dynamically quantized activations (pt2 with torchao, onnx with "
        "ONNX Runtime); int8-static: calibrated on validation batches (onnx)",
    )
    p.add_argument("--checkpoint", help="checkpoint directory (default: the newest complete one)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists and is not empty")
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="hf and safetensors: split the weights into files of at most this size "
        "(model-00001-of-0000N.safetensors with an index), e.g. 500MB or 2GiB (default: 5GB)",
    )
    _trust_argument(p)


def cmd_export(args) -> int:
    from kiln.export import export

    info = export(
        args.run_dir,
        args.format,
        args.out,
        checkpoint=args.checkpoint,
        quantize=args.quantize,
        force=args.force,
        max_shard_size=args.max_shard_size,
        trust=args.trust_checkpoint,
    )
    print(f"kiln: exported step {info['step']} of {args.run_dir} to {args.out} ({len(info['files'])} files)")
    for name, value in info.items():
        if isinstance(value, dict) and "max_abs_diff" in value:
            check = info["check"]
            where = check["inputs"]
            if "layers" in check:  # a streamed export: both models cut to a sample of their layers
                where += f"; layers {', '.join(map(str, check['layers']))} of {check['of_layers']}"
            print(f"  {name}: logits within {value['max_abs_diff']:.2e} of the PyTorch model ({where})")
    if "quantized" in info:
        q = info["quantized"]
        print(f"  int8: {q['size_ratio']:.0%} of the float size on disk")
        for name, r in q.items():
            if isinstance(r, dict):
                metric = next(iter(r["metric"]["float"]))
                print(
                    f"  {name} int8: {r['speedup']:.2f}x the float speed per token ({q['threads']} threads); "
                    f"{metric} {r['metric']['int8'][metric]:.4g} (float {r['metric']['float'][metric]:.4g})"
                )
    return 0


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR|EXPORT_DIR", help="run, checkpoint or export directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free one)")
    p.add_argument("--device", default="auto")
    p.add_argument("--model-name", help="the model's name in the API (default: the directory's name)")
    p.add_argument("--checkpoint", help="checkpoint directory (default: the newest complete one)")
    p.add_argument(
        "--max-batch",
        "--parallel",
        type=int,
        default=8,
        help="requests decoded at once, in one batch; the others wait in a queue (default 8)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=512,
        help="tokens one step feeds the model: one per running request, the rest chunks of new prompts (default 512)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step before serving (a minute or two first; then faster steps on small models)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("KILN_API_KEY"),
        help="require Authorization: Bearer KEY on every route but /health (default: $KILN_API_KEY; none)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help="the most tokens a request may fill, prompt and answer (default: the model's context)",
    )
    p.add_argument(
        "--max-queue", type=int, default=256, help="requests that may wait for a slot; past them, 429 (default 256)"
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may run before it is ended (default 600)",
    )
    _trust_argument(p)


def cmd_serve(args) -> int:
    from kiln.serve import serve

    return serve(
        args.run_dir,
        host=args.host,
        port=args.port,
        device=args.device,
        model_name=args.model_name,
        checkpoint=args.checkpoint,
        max_batch=args.max_batch,
        max_batch_tokens=args.max_batch_tokens,
        trust=args.trust_checkpoint,
        api_key=args.api_key,
        max_model_len=args.max_model_len,
        max_queue=args.max_queue,
        timeout=args.request_timeout,
        compiled=args.compile,
    )


def _sweep_args(p: argparse.ArgumentParser) -> None:
    from kiln.sweep import add_arguments

    _add_config_args(p)
    add_arguments(p)


def cmd_sweep(args) -> int:
    from kiln.sweep import sweep_command

    return sweep_command(args)


def _sweep_trial_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("study_dir", metavar="STUDY_DIR", help="the study directory (kiln sweep --study-dir)")
    p.add_argument("number", type=int, metavar="NUMBER", help="the trial's number")


def cmd_sweep_trial(args) -> int:
    from pathlib import Path

    from kiln.sweep.trial import PruningHook, trial_config
    from kiln.train.trainer import train

    study_dir = Path(args.study_dir)
    cfg = trial_config(study_dir, args.number)
    result = train(cfg, on_evaluate=PruningHook(study_dir, args.number, cfg.eval.every))
    return 0 if not result.interrupted else 130


def _launch_args(p: argparse.ArgumentParser) -> None:
    from kiln.distributed.launch import add_arguments

    add_arguments(p)


def cmd_launch(args) -> int:
    from kiln.distributed.launch import launch, torchrun_args

    try:
        argv = torchrun_args(args)
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return USAGE_ERROR
    return launch(argv)


COMMANDS: tuple[Command, ...] = (
    Command(
        "train",
        help="train a model (the embedded default corpus if no data is set)",
        arguments=_train_args,
        run=cmd_train,
    ),
    Command(
        "prepare",
        help="train the tokenizer and tokenize the data into shards (cached)",
        arguments=_add_config_args,
        run=cmd_prepare,
    ),
    Command(
        "eval",
        help="validation metrics of a run's checkpoint (loss, perplexity, bits per byte; a classifier's accuracy)",
        arguments=_eval_args,
        run=cmd_eval,
    ),
    Command("generate", help="sample text from a run's checkpoint", arguments=_generate_args, run=cmd_generate),
    Command(
        "config",
        help="print the resolved config as TOML, or the reference of every key",
        arguments=_config_args,
        run=cmd_config,
    ),
    Command("presets", help="list the model presets with their parameter counts", arguments=_no_args, run=cmd_presets),
    Command(
        "plan",
        help="estimate memory per device and time per step of a config, and the fastest layout that fits",
        description="Estimate the memory each device needs for a config and its time per step "
        "(compute, communication, pipeline bubble, MFU), without allocating the model; when it does "
        "not fit, or runs on several GPUs, list the fastest setups that fit as --set changes "
        "(docs/plan.md). The layout comes from the config: --set parallel.pp=4 --set parallel.tp=8 ...",
        arguments=_plan_args,
        run=cmd_plan,
    ),
    Command(
        "profile",
        help="profile a few training steps: a trace and where the step time goes",
        description="Train the config for a few steps in a throw-away run directory with "
        "torch.profiler over --steps; keep only the trace and the breakdown "
        "(docs/debugging.md). Same as kiln train --set profile.steps=START:END, "
        "without the run.",
        arguments=_profile_args,
        run=cmd_profile,
    ),
    Command(
        "doctor",
        help="preflight: environment, data, gradients, input pipeline and determinism",
        description="Check a config before a long run: each check passes, warns or fails with its "
        "evidence and the fix (docs/doctor.md). Exit status 1 when a check fails.",
        arguments=_doctor_args,
        run=cmd_doctor,
    ),
    Command(
        "report",
        help="plot a run's curves into a PNG and summarise it, or compare several runs in a table (no server needed)",
        arguments=_report_args,
        run=cmd_report,
    ),
    Command(
        "export",
        help="write a run's model in a format other tools load, checked against the model",
        description="Export a run's checkpoint (RUN_DIR: its newest; or a checkpoint directory). "
        "hf: a directory transformers loads with from_pretrained (for LoRA runs the merged model, and the "
        "adapter in PEFT's format under adapter/); safetensors: kiln's weights with the run's config and "
        "tokenizer (kiln generate/eval/serve load it); pt2: a torch.export program and an AOTInductor "
        "package; onnx: an ONNX model checked in ONNX Runtime. export.json records the logit difference "
        "from the PyTorch model on validation inputs (docs/export.md). A run saved in shards (FSDP, "
        "tensor or pipeline parallel) is exported to hf or safetensors one layer at a time, never whole.",
        arguments=_export_args,
        run=cmd_export,
    ),
    Command(
        "serve",
        help="serve a run's model over an OpenAI-compatible HTTP API (docs/serve.md)",
        description="Serve RUN_DIR (its newest checkpoint), a checkpoint directory, or a safetensors or hf "
        "export: /v1/completions, /v1/chat/completions (streaming or not), /v1/models and /health.",
        arguments=_serve_args,
        run=cmd_serve,
    ),
    Command(
        "sweep",
        help="search hyperparameters with Optuna; each trial is a kiln run (docs/sweep.md)",
        description="Run an Optuna study over the config keys of --space (one TOML table per key), each "
        "trial a kiln run in STUDY/trials/NNNN; prune trials that fall behind; continue the study when "
        "run again; write trials.csv, best.toml and sweep.png (docs/sweep.md).",
        arguments=_sweep_args,
        run=cmd_sweep,
    ),
    Command(
        "sweep-trial",
        help="train one trial of a sweep, reporting its evaluations to the study (kiln sweep runs this)",
        description="Train trial NUMBER of the sweep in STUDY_DIR: its config is STUDY_DIR/trials/NNNN/trial.toml "
        "(kiln sweep writes it); rank 0 reports each evaluation to the study and asks its pruner, and a pruned "
        "trial stops there with a checkpoint. kiln sweep starts each trial this way (under kiln launch for "
        "several ranks); run by hand, it continues an interrupted trial (docs/sweep.md).",
        arguments=_sweep_trial_args,
        run=cmd_sweep_trial,
    ),
    Command(
        "launch",
        help="run a kiln command on several processes/nodes with torchrun",
        description="A thin wrapper over torchrun: kiln launch --nproc-per-node 2 -- train my.toml",
        arguments=_launch_args,
        run=cmd_launch,
    ),
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln", description="Train Transformer models with PyTorch, efficiently.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for c in COMMANDS:
        c.arguments(sub.add_parser(c.name, help=c.help, description=c.description))
    return p


def _run(args) -> int:
    from kiln.checkpoint import CheckpointError
    from kiln.config import ConfigError
    from kiln.data import DataError
    from kiln.distributed import in_torchrun
    from kiln.harness.tasks import TaskError
    from kiln.models.family import ExportError
    from kiln.train.guard import TrainingDiverged
    from kiln.train.memory_ladder import OutOfMemoryExhausted, RestartForRung

    # Under torchrun every rank reports its own errors; the rank says whose they are.
    who = (
        f"kiln [rank {os.environ.get('RANK')}]"
        if in_torchrun() and os.environ.get("WORLD_SIZE", "1") != "1"
        else "kiln"
    )
    try:
        return {c.name: c.run for c in COMMANDS}[args.command](args)
    except ConfigError as e:
        for line in e.errors:
            print(f"{who}: config error: {line}", file=sys.stderr)
        return USAGE_ERROR
    except (DataError, CheckpointError, ExportError, TaskError, FileExistsError, FileNotFoundError) as e:
        print(f"{who}: error: {e}", file=sys.stderr)
        return USAGE_ERROR
    except (OutOfMemoryExhausted, RestartForRung) as e:
        print(f"{who}: {e}", file=sys.stderr)
        return OUT_OF_MEMORY
    except TrainingDiverged as e:
        print(f"{who}: training diverged: {e}", file=sys.stderr)
        return DIVERGED
    except KeyboardInterrupt:
        print(f"{who}: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from kiln.distributed import in_torchrun

    if in_torchrun():
        # An unexpected exception is written where the elastic agent reports it with the rank.
        from torch.distributed.elastic.multiprocessing.errors import record

        code = record(_run)(args)
        # None: the command raised SystemExit(0), which record swallows; the exit status is 0 either way.
        return 0 if code is None else code
    return _run(args)


def command() -> int:
    """The ``kiln`` command (and ``python -m kiln``): main(), then a quick exit."""
    code = main()
    # What kiln opened is closed by now. The interpreter's last collections would walk every
    # object of torch and its compiler stack, about 1.5 s on two CPU cores in every process (each
    # rank of a launch, each sweep trial); frozen objects are left to the exit to free.
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(command())
