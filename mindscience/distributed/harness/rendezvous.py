"""How the nodes of a run agree on a restart: a rendezvous through files of a shared folder.

``msdist train --max-restarts`` on a cluster runs one ``msdist`` per node. When a launch
fails, each node's launcher stops its own ranks; then every node that is still there
checks in for the next launch, node 0 decides, and every node follows the decision::

    <root>/attempt_<a>/node_<i>.json     node i is back for launch a (written atomically)
    <root>/attempt_<a>/decision.json     node 0's decision: the nodes of launch a, their
                                         new ranks, the layout, the checkpoint, the port

The folder is the ``--save`` folder's ``.rendezvous/``: checkpoints already need a folder
every node sees (rank 0 merges every rank's part of the manifest). Node 0 waits up to the
rejoin timeout for every node; a node that has not checked in by then is gone: without
``--elastic`` the run stops, with it the run goes on without that node. A node that is not
in the decision stops. Node 0 hosts the scheduler, so the run cannot outlive it.

Loopback nodes (``--loopback-nodes``) use the same files, each simulated node checking in
for itself from the one ``msdist`` process. No MindSpore import.

    >>> import tempfile
    >>> r = Rendezvous(tempfile.mkdtemp(), nodes=2, timeout_s=0.2)
    >>> r.check_in(1, 0, {"reason": "rank 1 died"})
    >>> r.present(1)
    [0]
"""

from __future__ import annotations

import json
import os
import time

POLL_S = 0.05


class RendezvousError(RuntimeError):
    """Node 0's decision did not come in time (a node that is not node 0)."""


def _write_atomic(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _read(path: str):
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


class Rendezvous:
    """The restart agreement of ``nodes`` nodes through the folder ``root``.

    Args:
        root: A folder every node sees.
        nodes: Nodes of the run's first launch.
        timeout_s: The rejoin timeout: how long node 0 waits for the others to check in,
            and (doubled) how long the others wait for node 0's decision.
    """

    def __init__(self, root: str, nodes: int, timeout_s: float):
        self.root, self.nodes, self.timeout_s = root, nodes, timeout_s

    def _dir(self, attempt: int) -> str:
        path = os.path.join(self.root, f"attempt_{attempt}")
        os.makedirs(path, exist_ok=True)
        return path

    def check_in(self, attempt: int, node: int, info: dict | None = None) -> None:
        """Node ``node`` (its index in the first launch) is ready for launch ``attempt``."""
        _write_atomic(os.path.join(self._dir(attempt), f"node_{node}.json"),
                      {"node": node, "time": time.time(), **(info or {})})

    def present(self, attempt: int) -> list:
        """The nodes that have checked in for ``attempt`` so far."""
        folder = self._dir(attempt)
        return sorted(int(n[5:-5]) for n in os.listdir(folder) if n.startswith("node_") and n.endswith(".json"))

    def gather(self, attempt: int, expected) -> tuple:
        """Node 0: wait until every node of ``expected`` checked in, or the timeout.

        Returns:
            ``(present nodes, seconds waited)``.
        """
        started = time.monotonic()
        expected = set(expected)
        while True:
            here = self.present(attempt)
            if expected <= set(here) or time.monotonic() - started >= self.timeout_s:
                return sorted(set(here) & expected), time.monotonic() - started
            time.sleep(POLL_S)

    def infos(self, attempt: int) -> dict:
        """``{node: what it checked in with}`` for ``attempt``."""
        folder = self._dir(attempt)
        return {n: _read(os.path.join(folder, f"node_{n}.json")) for n in self.present(attempt)}

    def decide(self, attempt: int, decision: dict) -> None:
        """Node 0: publish the decision of launch ``attempt`` (written last, atomically)."""
        _write_atomic(os.path.join(self._dir(attempt), "decision.json"), decision)

    def await_decision(self, attempt: int) -> dict:
        """Another node: node 0's decision for ``attempt``.

        Raises:
            RendezvousError: none within twice the rejoin timeout.
        """
        path = os.path.join(self._dir(attempt), "decision.json")
        deadline = time.monotonic() + 2 * self.timeout_s + 5
        while time.monotonic() < deadline:
            decision = _read(path)
            if decision is not None:
                return decision
            time.sleep(POLL_S)
        raise RendezvousError(f"no restart decision from node 0 in {path} within {2 * self.timeout_s + 5:g} s: "
                              "is node 0's msdist still running, and is the --save folder shared by every node?")
