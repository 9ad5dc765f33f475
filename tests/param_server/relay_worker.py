"""Subprocess for test_relay: a worker's weight source over a relay, in a process of its own (so a
test can SIGKILL it mid-transfer, as a host dies, with its connections reset by the kernel).

    python tests/param_server/relay_worker.py PARAM_SERVER EGRESS_BYTES_PER_S

Prints {"endpoint"} once serving; then for each stdin line {"version", "sources"} fetches that
version of ``test_relay._tree``'s structure onto its CPU device, printing {"filled"} at its
first verified bucket and, at the end, {"sha256" of every leaf's bytes in tree order, "relayed",
"pulled"} or {"error"}.
"""

import hashlib
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rlax_tpu.param_server.client import ParamServerClient, PulledWeights  # noqa: E402
from rlax_tpu.param_server.relay import RelayedWeights, RelayServer  # noqa: E402
from tests.param_server.test_relay import _tree  # noqa: E402


def _say(**what: object) -> None:
    print(json.dumps(what), flush=True)


def main() -> None:
    endpoint, rate = sys.argv[1], float(sys.argv[2])
    server = RelayServer(egress_bytes_per_s=rate, appear_s=5)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree_util.tree_map(lambda _: device, _tree(0))
    client = ParamServerClient(endpoint, timeout_s=60)
    source = RelayedWeights(server, shardings, PulledWeights(client, shardings))
    _say(endpoint=server.endpoint)
    for line in sys.stdin:
        job = json.loads(line)
        source.sources = tuple(job["sources"])
        done = threading.Event()

        def watch(version: int = job["version"], done: threading.Event = done) -> None:
            while not done.is_set():
                held = server.get(version)
                if held is not None and held.filled >= 1:
                    _say(filled=held.filled)
                    return
                time.sleep(0.002)

        threading.Thread(target=watch, daemon=True).start()
        try:
            tree = source.fetch(job["version"])
        except Exception as e:  # noqa: BLE001 - reported to the test
            done.set()
            _say(error=f"{type(e).__name__}: {e}")
            continue
        done.set()
        digest = hashlib.sha256()
        for leaf in jax.tree_util.tree_leaves(tree):
            digest.update(np.asarray(leaf).tobytes())
        _say(sha256=digest.hexdigest(), **{k: source.counts[k] for k in ("relayed", "pulled")})


if __name__ == "__main__":
    main()
