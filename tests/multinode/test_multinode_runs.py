"""Multi-node runs simulated with real processes: gloo over loopback, one launch per simulated node.

Every run is ``_multinode_run.py`` (4 processes in all) under a progress-based deadline that kills its whole
process group. The reference is one node with 4 processes; the others lay the same world size out as 2
nodes x 2 processes, launched by Lightning (``NODE_RANK``, node-local directories) or by
``torchrun`` (``TorchElasticEnvironment``, one shared directory). Runs start on first use and are
shared by the tests of this module. The plain module is a small MLP with dropout and a shuffled
loader with a worker; the DeepEP agent is the reference workload in miniature. The two reference
launches fit the plain module, then the DeepEP agent in the same processes (into ``deepep/``), so the
DeepEP comparison starts no processes of its own; the 2 x 2 launch then fits the other node-local runs
in turn in the same processes and process group (``--then``): the fault, the planted local-rank bug and
last the run that is SIGKILLed. Each of these fits starts from ``configure(SEED)`` and a new Trainer, and
is compared step by step with the 1 x 4 reference, whose plain fit is the first of its processes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import free_port

from deepep_lightning.determinism.streams import derive_seed
from deepep_lightning.strategies import CHECKPOINT_KEY

SCRIPT = Path(__file__).with_name("_multinode_run.py")
SEED, NUM_SAMPLES, MAX_STEPS = 4321, 64, 12  # as in _multinode_run.py; 4 steps per epoch
KILL_AT, CKPT_EVERY = 7, 3  # killed at step 7 of epoch 1; resumed from the mid-epoch checkpoint of step 6
FAULT_RANK, FAULT_STEP, CORRUPT_RANK = 2, 5, 3  # both on the second node

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed"),
]


@dataclass(frozen=True)
class Run:
    """One launch: ``_multinode_run.py`` arguments, simulated nodes, node-local directories, the exit code expected."""

    args: list[str] = field(default_factory=list)
    nodes: int = 1
    node_local: bool = False
    expect: int = 0
    # later fits in the same processes (``--then``): (name, arguments), each into its own directories
    then: tuple[tuple[str, tuple[str, ...]], ...] = ()


class Runs:
    """Launches a run the first time a test asks for it; ``dirs[name][node]`` is that node's directory."""

    def __init__(self, root: Path, fit_process) -> None:
        self.root, self.fit_process = root, fit_process
        self.dirs: dict[str, list[Path]] = {}
        self.codes: dict[str, list[int]] = {}

    def launch(self, name: str, *args: str, nodes: int = 1, node_local: bool = False, expect: int = 0) -> list[Path]:
        return self.launch_together({name: Run(list(args), nodes, node_local, expect)})[name]

    def launch_together(self, runs: dict[str, Run]) -> dict[str, list[Path]]:
        """Start every run not made yet at once (their start-ups overlap); the node directories of every run
        and of every fit chained after one (``Run.then``)."""
        processes, made = {}, {}
        for name, run in runs.items():
            if name in self.dirs:
                continue
            port = str(free_port())
            fits = [(name, tuple(run.args)), *run.then]
            for fit, _ in fits:
                made[fit] = [self.root / fit / (f"node{n}" if run.node_local else "") for n in range(run.nodes)]
            for n in range(run.nodes):
                args = ["--num-nodes", str(run.nodes), "--node-rank", str(n), "--devices", str(4 // run.nodes)]
                args += ["--port", port]
                for i, (fit, fit_args) in enumerate(fits):
                    args += [*(["--then"] if i else []), "--out", str(made[fit][n]), *fit_args]
                processes[name, n] = self.fit_process(
                    SCRIPT, args, log_path=self.root / name / f"node{n}.log", cwd=self.root
                )
        codes = self.fit_process.wait_all(processes)
        for (name, n), code in codes.items():
            self.codes.setdefault(name, []).append(code)
            assert code == runs[name].expect, processes[name, n].output_tail()
        self.dirs.update(made)
        return {name: self.dirs[name] for name in runs} | {
            fit: self.dirs[fit] for run in runs.values() for fit, _ in run.then
        }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fit_process) -> Runs:
    return Runs(tmp_path_factory.mktemp("multinode"), fit_process)


def _node_of(dirs: list[Path], rank: int) -> Path:
    return dirs[0] if len(dirs) == 1 else dirs[rank // 2]


def _record(dirs: list[Path], rank: int) -> dict:
    return json.loads((_node_of(dirs, rank) / f"rank{rank}.json").read_text())


def _weights(dirs: list[Path], rank: int) -> dict[str, torch.Tensor]:
    return torch.load(_node_of(dirs, rank) / f"weights_rank{rank}.pt", weights_only=True)


def _trace(dirs: list[Path], rank: int) -> list[list]:
    """Rows ``[step, input sum, stream draw, parameter sum, loss, logged loss]``, one per step of the loop."""
    return [json.loads(line) for line in (_node_of(dirs, rank) / f"trace.rank{rank}.jsonl").read_text().splitlines()]


def _bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


_BOTH = ["--module", "tiny,deepep"]  # the plain module, then DeepEP in DIR/deepep
_TWO_NODE_FITS = (
    # rank 2 (node 1) gets an infinite loss at step 5; rank 3 (node 1) cannot read its newest snapshot (step 4)
    (
        "fault-2x2",
        ("--fault-rank", str(FAULT_RANK), "--fault-step", str(FAULT_STEP), "--corrupt-rank", str(CORRUPT_RANK)),
    ),
    # a planted bug: the per-step streams keyed by the local rank, one step
    ("local-rank-bug", ("--seed-by-local-rank", "--max-steps", "1")),
    # last: SIGKILLed at step 7, with checkpoints every 3 steps in one directory of both nodes (relative to
    # the launches' working directory, Runs.root)
    ("killed-2x2", ("--ckpt-dir", "checkpoints", "--ckpt-every", str(CKPT_EVERY), "--kill-at", str(KILL_AT))),
)
_REFERENCE = {"1x4": Run(_BOTH), "2x2": Run(_BOTH, nodes=2, node_local=True, expect=-9, then=_TWO_NODE_FITS)}


def _reference(runs: Runs) -> list[Path]:
    return runs.launch_together(_REFERENCE)["1x4"]


def _two_nodes(runs: Runs, fit: str = "2x2") -> list[Path]:
    """The node directories of the 2 x 2 reference fit or of a fit chained after it (``_TWO_NODE_FITS``)."""
    return runs.launch_together(_REFERENCE)[fit]


def test_comparison_detects_one_ulp():
    # negative control for the bitwise assertions below
    a, b = {"w": torch.ones(3)}, {"w": torch.ones(3)}
    b["w"][1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert not _bitwise_equal(a, b)


def test_two_nodes_of_two_equal_one_node_of_four(runs):
    one, two = _reference(runs), _two_nodes(runs)
    for rank in range(4):
        assert _bitwise_equal(_weights(two, rank), _weights(one, rank))
        assert _trace(two, rank) == _trace(one, rank)  # losses, logged scalars, inputs, streams, step by step
        assert len(_trace(one, rank)) == MAX_STEPS
    assert _bitwise_equal(_weights(one, 0), _weights(one, 3))  # DDP keeps the ranks equal
    logged = {row[5] for rank in range(4) for row in _trace(one, rank)[:1]}
    assert len(logged) == 1  # the logged scalar is the rank average: one value on every rank


def test_global_rank_decides_seeds_shards_and_layout_records(runs):
    one, two = _reference(runs), _two_nodes(runs)
    records = [_record(two, rank) for rank in range(4)]
    assert [(r["global_rank"], r["node_rank"], r["local_rank"]) for r in records] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    assert [r["rank_seed"] for r in records] == [derive_seed(SEED, "rank", rank) for rank in range(4)]
    for epoch in ("0", "1", "2"):
        seen = [records[rank]["seen"][epoch] for rank in range(4)]
        assert sorted(sum(seen, [])) == list(range(NUM_SAMPLES))  # disjoint shards covering the data
        assert seen == [_record(one, rank)["seen"][epoch] for rank in range(4)]
    # global rank 2 is local rank 0 of node 1: keyed by the local rank it would repeat rank 0's streams
    draws = [r["first_dropout_draw"] for r in records]
    assert len(set(draws)) == 4 and draws == [_record(one, rank)["first_dropout_draw"] for rank in range(4)]
    fingerprint = records[3]["fingerprint"]
    assert fingerprint["ddp.num_nodes"] == "2" and fingerprint["ddp.node_layout"] == "2 nodes x 2 processes"
    assert fingerprint["ddp.cluster_environment"] == "LightningEnvironment"
    assert fingerprint["ddp.gradient_reduction"] == "ordered"
    assert _record(one, 0)["fingerprint"]["ddp.node_layout"] == "1 node x 4 processes"


def test_snapshots_on_node_local_and_shared_directories(runs):
    one, two = _reference(runs), _two_nodes(runs)
    for node, directory in enumerate(two):  # node-local: each node holds the snapshots of its own ranks
        assert sorted(p.name for p in (directory / "snapshots").iterdir()) == [f"rank{2 * node}", f"rank{2 * node + 1}"]
    assert sorted(p.name for p in (one[0] / "snapshots").iterdir()) == [f"rank{r}" for r in range(4)]
    for dirs in (one, two):
        for rank in range(4):
            record = _record(dirs, rank)
            assert Path(record["snapshot_dir"]) == _node_of(dirs, rank) / "snapshots" / f"rank{rank}"
            # keep_snapshots=3 of every 2 steps, all of this run (one run id, broadcast from rank 0)
            assert [name.rsplit("-", 1)[1] for name in record["snapshot_files"]] == [
                "step000000008.pt",
                "step000000010.pt",
                "step000000012.pt",
            ]
            assert record["snapshot_files"][0].split("-")[1] == _record(dirs, 0)["snapshot_files"][0].split("-")[1]


def test_negative_control_streams_keyed_by_the_local_rank_break_the_equality(runs):
    # a planted bug: the per-step streams keyed by the local rank, 2 nodes x 2, one step
    broken = _two_nodes(runs, "local-rank-bug")
    one = _reference(runs)
    rows = [_trace(broken, rank)[0] for rank in range(4)]
    assert rows[2][2] == rows[0][2] and rows[3][2] == rows[1][2]  # node 1 repeats node 0's streams
    assert rows[2][2] != _trace(one, 2)[0][2]
    assert rows[2][4] != _trace(one, 2)[0][4]  # rank 2's loss: the masks differ
    # node 0 is unaffected (its own loss; the logged average takes node 1's in): the bug, not the launch
    assert rows[0][:5] == _trace(one, 0)[0][:5] and rows[0][5] != _trace(one, 0)[0][5]


def test_deepep_on_two_nodes_equals_one_node(runs):
    one = [directory / "deepep" for directory in _reference(runs)]
    two = [directory / "deepep" for directory in _two_nodes(runs)]
    for rank in range(4):
        assert _bitwise_equal(_weights(two, rank), _weights(one, rank))
        assert _trace(two, rank) == _trace(one, rank) and len(_trace(one, rank)) == MAX_STEPS
    # rollouts follow the global rank: rank 2 (local rank 0 of node 1) does not repeat rank 0's episodes
    losses = [[row[1] for row in _trace(two, rank)] for rank in range(4)]
    assert len({tuple(rank_losses) for rank_losses in losses}) == 4


def test_torchrun_environment_gives_the_same_run(runs):
    elastic = runs.launch("torchrun-2x2", "--launcher", "torchrun", nodes=2)  # one shared directory
    one = _reference(runs)
    for rank in range(4):
        record = _record(elastic, rank)
        assert record["cluster_environment"] == "TorchElasticEnvironment"
        assert (record["node_rank"], record["local_rank"]) == divmod(rank, 2)
        assert _bitwise_equal(_weights(elastic, rank), _weights(one, rank))
        assert _trace(elastic, rank) == _trace(one, rank)
    assert sorted(p.name for p in (elastic[0] / "snapshots").iterdir()) == [f"rank{r}" for r in range(4)]


def test_sigkill_on_two_nodes_resumes_bitwise_on_one(runs):
    shared = runs.root / "checkpoints"
    killed = _two_nodes(runs, "killed-2x2")
    checkpoint = torch.load(shared / "last.ckpt", weights_only=False)
    state = checkpoint[CHECKPOINT_KEY]
    assert checkpoint["global_step"] == 6 and (state["num_nodes"], state["processes_per_node"]) == (2, 2)
    assert len(state["per_rank"]) == 4
    resumed = runs.launch("resumed-1x4", "--resume", str(shared / "last.ckpt"))
    one = _reference(runs)
    for rank in range(4):
        before, after = _trace(killed, rank), _trace(resumed, rank)
        assert [row[0] for row in before] == list(range(KILL_AT)) and after[0][0] == 6  # mid-epoch, replayed
        assert before == _trace(one, rank)[:KILL_AT] and after == _trace(one, rank)[6:]
        assert _bitwise_equal(_weights(resumed, rank), _weights(one, rank))
    assert (
        "resuming a run of 2 nodes x 2 processes on 1 node x 4 processes"
        in (runs.root / "resumed-1x4" / "node0.log").read_text()
    )


def test_nan_on_the_second_node_and_a_corrupt_snapshot_there_roll_back_every_rank(runs):
    # rank 2 (node 1) gets an infinite loss at step 5; rank 3 (node 1) cannot read its newest snapshot (step 4)
    faulty = _two_nodes(runs, "fault-2x2")
    one = _reference(runs)
    for rank in range(4):
        events = [tuple(event) for event in _record(faulty, rank)["events"]]
        corrupt = [("corrupt_snapshot", FAULT_STEP + 1)] if rank == CORRUPT_RANK else []
        # all four agree on the older snapshot (step 2) because rank 3 cannot load the newest (step 4)
        assert events == [("detected", FAULT_STEP), *corrupt, ("rollback", 2), ("transient", FAULT_STEP)]
        assert _trace(faulty, rank) == _trace(one, rank)  # every step as in the clean run
        assert _bitwise_equal(_weights(faulty, rank), _weights(one, rank))
    # the agreed events go to the job's log, written by global rank 0 on its node; node 1 writes none
    log_lines = (faulty[0] / "health_events.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in log_lines][:1] == ["detected"]
    assert not (faulty[1] / "health_events.jsonl").exists()
