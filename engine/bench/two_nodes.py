"""Two computers as one, measured on one two-GPU host: two nodes of one GPU each, talking NCCL over sockets.

``python -m engine.bench.two_nodes --out benchmarks/two_nodes_h200x2`` trains the same LoRA run three times through
the product's own entry point (``engine.train.run``, as ``tunedeck train`` does), on a random-weight model folder of
the named shape (engine.bench.model_folder; no download) and the same rows, with the same global batch
(``grad_accum`` rows a step):

- ``1 GPU``: one process;
- ``1 node x 2 GPUs``: ``--gpus 2`` (NCCL as usual: NVLink or PCIe peer-to-peer);
- ``2 nodes x 1 GPU``: two launchers, ``--nodes 2 --node-rank 0|1 --rendezvous 127.0.0.1:PORT``, each seeing one
  GPU, with NCCL forced onto TCP sockets over the loopback (``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
  NCCL_NET=Socket NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo``): what two machines joined by a network see, minus the
  wire's latency and bandwidth limits.

It reports tokens/s (the median of the steps after ``--warmup``), the scaling against one GPU, and every run's loss
curve, which must agree within bf16 noise. Writes ``OUT.json`` and ``OUT.md``; prints the table last.
``--device cpu --shape tiny`` runs the same three paths on gloo processes (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from engine.bench import write_report

SOCKETS_ONLY = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_NET": "Socket",
    "NCCL_IB_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "lo",
    "GLOO_SOCKET_IFNAME": "lo",
}
NETWORK_NOTE = (
    "Between two real machines the same socket path also pays the wire: each step all-reduces the LoRA gradients "
    "(4 bytes a trainable parameter, in buckets during backward) and a few small gloo messages, so on 1 Gbit/s "
    "Ethernet (~0.1 GB/s, ~0.2 ms a round trip) a 1B model's rank-16 adapter (~11 M parameters, ~45 MB) adds about "
    "0.4 s a step that backward cannot hide; a DGX Spark pair's 200 Gbit/s RoCE link makes that a few ms."
)
LAUNCHER = """
import json, sys
from engine.cli.train import train_config, train_parser
from engine.train import run
for event in run(train_config(train_parser().parse_args(sys.argv[1:]))):
    print("@event " + json.dumps(event.to_dict()), flush=True)
"""


def train_flags(args: argparse.Namespace, model: Path, data: Path, out: Path, name: str) -> list[str]:
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    return [
        f"--model={model}", f"--data={data}", "--data-format=text", "--train-on-all-tokens",
        f"--max-seq-len={args.tokens}", f"--tokens-per-batch={args.tokens}", "--eval-fraction=0",
        f"--max-steps={args.steps}", "--grad-accum=2", "--lr=1e-4", "--warmup-steps=1", "--save-every=0",
        "--lora-dropout=0", f"--model-dtype={dtype}", f"--device={args.device}", f"--output={out}", f"--name={name}",
    ]  # fmt: skip


def launch(flags: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    root = str(Path(__file__).resolve().parents[2])
    full = {**os.environ, "PYTHONPATH": root, **env}
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, *flags], env=full, stdout=subprocess.PIPE, text=True, cwd=root
    )


def collect(process: subprocess.Popen[str], timeout: float) -> list[dict[str, Any]]:
    assert process.stdout is not None
    events = [json.loads(line[7:]) for line in process.stdout if line.startswith("@event ")]
    process.wait(timeout=timeout)
    failed = [e for e in events if e["kind"] == "RunFailed"]
    if failed or not events or events[-1]["kind"] != "RunFinished":
        raise RuntimeError(f"a run failed: {failed[-1] if failed else events[-3:]}")
    return events


def summary(label: str, gpus: int, events: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    steps = [e for e in events if e["kind"] == "StepMetrics"]
    timed = steps[warmup:] or steps
    notices = [e["message"] for e in events if e["kind"] == "Notice" and " over " in e["message"]]
    return {
        "run": label,
        "gpus": gpus,
        "tokens_per_s": statistics.median(s["tokens_per_s"] for s in timed),
        "step_ms_median": statistics.median(s["step_time_s"] for s in timed) * 1e3,
        "losses": [s["loss"] for s in steps],
        "link": notices[0] if notices else None,
        **node_busy(events, warmup),
    }


def node_busy(events: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """A run over nodes: each node's devices and median busy ms a step (engine.run.busy); {} otherwise."""
    figures = [e for e in events if e["kind"] == "NodeFigures"]
    timed = figures[warmup:] or figures
    if not timed:
        return {}
    nodes = range(len(timed[0]["devices"]))
    busy = [statistics.median(f["step_time_s"][node] for f in timed) * 1e3 for node in nodes]
    return {"node_devices": timed[0]["devices"], "node_busy_ms_median": busy}


def measure(args: argparse.Namespace, model: Path, data: Path, out: Path) -> list[dict[str, Any]]:
    one_gpu = {"CUDA_VISIBLE_DEVICES": "0"} if args.device != "cpu" else {}
    timeout, warmup = args.timeout, args.warmup
    one = collect(launch(train_flags(args, model, data, out, "one"), one_gpu), timeout)
    two = collect(launch([*train_flags(args, model, data, out, "gpus2"), "--gpus=2"], {}), timeout)
    results = [summary("1 GPU", 1, one, warmup), summary("1 node x 2 GPUs", 2, two, warmup)]
    port = free_port()
    node_flags = ["--nodes=2", f"--rendezvous=127.0.0.1:{port}", "--rendezvous-timeout=120"]
    nodes = [
        launch(
            [*train_flags(args, model, data, out, "nodes2"), *node_flags, f"--node-rank={rank}"],
            {**SOCKETS_ONLY, **({"CUDA_VISIBLE_DEVICES": str(rank)} if args.device != "cpu" else {})},
        )
        for rank in (0, 1)
    ]
    events = [collect(node, timeout) for node in nodes]
    results.append(summary("2 nodes x 1 GPU (NCCL sockets)", 2, events[0], warmup))
    return results


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def markdown(report: dict[str, Any]) -> str:
    base = report["results"][0]["tokens_per_s"]
    lines = [
        f"# Two nodes on one host: {report['shape']}, {report['tokens']:,} tokens a row, global batch 2 rows",
        "",
        f"{report['environment']}; NCCL for the two nodes: {' '.join(f'{k}={v}' for k, v in SOCKETS_ONLY.items())}",
        "",
        "| run | GPUs | step (ms, median) | tokens/s | vs 1 GPU | max loss difference from 1 GPU |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    reference = report["results"][0]["losses"]
    for row in report["results"]:
        gap = max((abs(a - b) for a, b in zip(row["losses"], reference, strict=False)), default=0.0)
        lines.append(
            f"| {row['run']} | {row['gpus']} | {row['step_ms_median']:.1f} | {row['tokens_per_s']:,.0f} "
            f"| {row['tokens_per_s'] / base:.2f}x | {gap:.4f} |"
        )
    lines += ["", "Loss curves:", ""]
    lines += [f"- {row['run']}: " + ", ".join(f"{v:.4f}" for v in row["losses"]) for row in report["results"]]
    for row in report["results"]:
        if row.get("node_busy_ms_median"):
            busy = ", ".join(
                f"node {node} ({device}) {ms:.1f} ms"
                for node, (device, ms) in enumerate(zip(row["node_devices"], row["node_busy_ms_median"], strict=True))
            )
            lines += ["", f"Busy time a step, waits for the other node left out ({row['run']}, median): {busy}"]
    links = [row["link"] for row in report["results"] if row["link"]]
    lines += ["", *(f"Link: {link}" for link in links), "", NETWORK_NOTE]
    return "\n".join(lines) + "\n"


def environment(device: str) -> str:
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return f"CPU (gloo); torch {torch.__version__}"
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    name = torch.cuda.get_device_name()
    return f"{name} x{torch.cuda.device_count()}; torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.two_nodes", description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b", help="engine.bench.model_folder shape, or 'tiny'")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of each packed row (one row a GPU a pass)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps of each run")
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of tokens/s")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for each run")
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from engine.bench.model_folder import build_model_folder, write_rows

    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        model, data = Path(folder) / "model", Path(folder) / "rows.jsonl"
        tiny = args.shape == "tiny"
        build_model_folder("llama-3.2-1b" if tiny else args.shape, model, tiny=tiny)
        write_rows(data, rows=4 * args.steps, words=args.tokens // 3)
        try:
            results = measure(args, model, data, Path(folder) / "runs")
        except RuntimeError as err:
            print(err, file=sys.stderr)
            return 1
    report = {
        "shape": args.shape,
        "tokens": args.tokens,
        "steps": args.steps,
        "warmup": args.warmup,
        "environment": environment(args.device),
        "sockets_only": SOCKETS_ONLY,
        "results": results,
    }
    table = markdown(report)
    if args.out is None:
        print(table)
    else:
        write_report(report, args.out.with_suffix(".json"), table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
