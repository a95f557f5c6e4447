"""A rank's first moments in a run over several computers: agreeing with node 0, and taking what node 0 holds.

After the process group stands, every rank sends node 0 a description of what it would train
(engine.distributed.preflight); all compare, and a difference stops every rank with one message. Then every node
trains node 0's settings with its own file paths, and resumes when node 0 resumes: only node 0 has the run folder,
so rank 0 sends its files (the logs and every whole checkpoint, not the adapters) to the first rank of each other
node, which writes them into that node's working folder, from which its ranks restore as if they were local.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import RunConfig
from engine.distributed.nodes import Place
from engine.distributed.preflight import LOCAL_SETTINGS, check_identities, node_identity
from engine.run.ranks import Ranks


@dataclass(frozen=True)
class Agreed:
    """What every node trains: node 0's settings with this node's paths, whether node 0 resumes, its run folder."""

    config: RunConfig
    resuming: bool
    main_run_dir: str
    links: list[str]


def agree(ranks: Ranks, place: Place, config: RunConfig, resuming: bool, run_dir: Path, link: str) -> Agreed:
    """Compare every node with node 0 (raises one ConfigError on every rank) and take node 0's run settings."""
    import torch.distributed as dist

    mine = {"identity": _identity(config, link), "config": config.to_dict(), "resume": resuming}
    mine["run_dir"] = str(run_dir)
    gathered: list[Any] = [None] * ranks.world
    dist.all_gather_object(gathered, mine, group=ranks.control_group)
    main = gathered[0]
    identities = [entry["identity"] for entry in gathered]
    if main["resume"]:  # node 0's saved settings govern a resume: its checkpoint was made with them
        identities = [{**identity, "settings": {}} for identity in identities]
    check_identities(identities, place.node_of_rank)
    links = [gathered[r]["identity"]["link"] for r in _first_ranks(place)]
    return Agreed(_with_local_paths(main["config"], config), main["resume"], main["run_dir"], links)


def _identity(config: RunConfig, link: str) -> dict[str, Any]:
    """This node's identity, or the reason it has none (its dataset cannot be read): sent either way, so that no
    node waits for one that gave up alone."""
    try:
        return node_identity(config, link)
    except Exception as err:
        return {"problem": getattr(err, "message", None) or str(err), "link": link}


def _first_ranks(place: Place) -> list[int]:
    return [place.node_of_rank.index(node) for node in range(place.nodes)]


def _with_local_paths(main: dict[str, Any], mine: RunConfig) -> RunConfig:
    raw = {section: dict(values) if isinstance(values, dict) else values for section, values in main.items()}
    own = mine.to_dict()
    for section, name in LOCAL_SETTINGS:
        raw[section][name] = own[section][name]
    return RunConfig.from_dict(raw)


def share_run_folder(ranks: Ranks, place: Place, run_dir: Path, local_rank: int) -> None:
    """Copy node 0's run folder (logs and checkpoints) to every other node's working folder (a collective)."""
    files = _folder_files(run_dir) if ranks.is_main else None
    files = ranks.broadcast_object(files)
    if place.node != 0 and local_rank == 0 and files:
        for relative, data in files.items():
            target = run_dir / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    ranks.barrier()


def _folder_files(run_dir: Path) -> dict[str, bytes]:
    from engine.run.folder import CHECKPOINT_DIR

    chosen = [p for p in run_dir.iterdir() if p.is_file()]
    checkpoints = run_dir / CHECKPOINT_DIR
    if checkpoints.is_dir():
        chosen += [p for p in checkpoints.rglob("*") if p.is_file()]
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in chosen}
