"""Where the two-Q-buffer build of the D=64 forward loses its time (kernels/README.md, "Two Q buffers"): writes
throwaway copies of kernels/forward_ws.py with two Q buffers on (Q_BUFFER_DIMS = (64,)) and one change each, for
revision_ab.py to time against the package's one buffer in turns.

  plain     two buffers as the package builds them
  held      the loader also waits for the last item's release of the other buffer, so the items start as with one
            buffer: the two-buffer build with one buffer's timing (sixty-fifth session: 1.07-1.09x slower at d=0.5
            and 0.25, 1.02-1.03x at d=0.1; Nsight Compute: the consumers' exponentials collide more)
  one-used  two buffers allocated (shared memory 225 KiB, barriers and posts two each) but every item in the first:
            whether the loss comes with the allocation or with Q's address alternating between items (its sm_90
            SASS under Triton 3.6 is one buffer's but for the barriers 16 KiB further on, the second buffer's
            barriers' initialization and about 130 lines that ptxas orders otherwise; sixty-sixth session, H100:
            as fast as one buffer, 0.98-1.03x, so not the allocation)
  runtime   two buffers allocated, taken in turn only where the launch's lists hold fewer than ALTERNATE_KEYS keys
            an item on average (a flag the launch appends to ITEM_ORDER on the GPU, cached per lists tensor, that
            _q_buffer reads per item): what a launch could ship to get two buffers' gain on short lists only
  runtime-never  the same with the flag always 0 (every item in the first buffer, as one-used, chosen at run time)

Sixty-sixth session (H100, raw output in results-2026-12-07-h100-session66.md): runtime 1.05-1.08x slower at d=0.5
and 0.25 (flag 0) and 0.97x at d=0.1 (flag 1); runtime-never 1.05-1.07x slower at d=0.5 and 0.25 and 1.00-1.05x at
d=0.1. So whatever makes Q's buffer a run-time value costs the time, even where it never changes; and giving each
buffer its own copy of the item's code (benchmarks/patches/q-buffers-unrolled.patch) cost more: 1.05-1.09x slower at
d=0.5 and 0.25 and 1.22-1.25x at d=0.1, where the doubled code (960 HGMMA instructions against 480) counts most;
less code (benchmarks/patches/no-cold-walk.patch) lost 6-10% at d=0.5 as well (kernels/README.md).

    python benchmarks/q_buffer_probe.py --out /tmp/probe        # writes /tmp/probe/forward_ws_<way>.py
    cd benchmarks && python revision_ab.py --base held --base-file /tmp/probe/forward_ws_held.py \\
        --cases d64-densities --rounds 5

Each copy is the working tree's file with exact substitutions; one that no longer matches the file fails here, by
name, rather than time something else.
"""

import argparse
import os

KERNEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "blockattn", "kernels", "forward_ws.py")
TWO_BUFFERS = ("Q_BUFFER_DIMS: tuple = ()", "Q_BUFFER_DIMS: tuple = (64, )")
LOADER_WAIT = "    mbarrier.wait(q_empty.index(buffer), phase ^ 1)\n"
# each way's substitutions (old, new), after TWO_BUFFERS
WAYS = {
    "plain": [],
    "held": [(LOADER_WAIT, LOADER_WAIT + "    if q_smem.shape[0] == 4:  # (probe) one buffer's timing\n"
              "        other, other_phase = _q_buffer(ring, turn + 1)\n"
              "        mbarrier.wait(q_empty.index(other), other_phase ^ 1)\n")],
    "one-used": [("    BUFFERS: gl.constexpr = ring[0].shape[0] // 2\n",
                  "    BUFFERS: gl.constexpr = 1  # (probe) two allocated, the first used\n")],
}
# (probe) the runtime ways: the mean keys an item under which the items take the two buffers in turn
ALTERNATE_KEYS = {"runtime": 6144, "runtime-never": 0}
Q_BUFFER_RUNTIME = (
    "def _q_buffer(ring, turn):",
    "    return turn % BUFFERS, (turn // BUFFERS) & 1\n",
    "def _q_buffer(shared, turn):",
    "    if BUFFERS == 1:\n"
    "        return turn % BUFFERS, (turn // BUFFERS) & 1\n"
    "    else:  # (probe) the launch's flag after ITEM_ORDER's items: take the buffers in turn or the first only\n"
    "        lists = shared[2]\n"
    "        alternate = gl.load(lists[6] + lists[5])\n"
    "        return turn & alternate, (turn >> alternate) & 1\n")
ORDER_CALL = ("        tensors[\"ITEM_ORDER\"] = cached_query_tile_order(kv_count, batch, heads, heads // k.shape[1], "
              "block_q, q_tiles,\n                                                        chosen.causal)\n")


def _substitute(source: str, way: str, pairs: list, times: int = 1) -> str:
    """source with each (old, new) of pairs replaced, in order; a ValueError naming way where an old string does not
    occur exactly `times` times (the file has moved on from the copy's substitutions)."""
    for old, new in pairs:
        if source.count(old) != times:
            raise ValueError(f"way {way!r}: {old.strip()!r} occurs {source.count(old)} times in forward_ws.py, "
                             f"expected {times}")
        source = source.replace(old, new)
    return source


def runtime_way(source: str, way: str) -> str:
    """The runtime ways' substitutions (see the docstring): _q_buffer reads the launch's flag, which the launch
    appends to ITEM_ORDER (mean keys an item below ALTERNATE_KEYS[way]), cached per lists tensor as the order is."""
    name, body, new_name, new_body = Q_BUFFER_RUNTIME
    order = ("        order = cached_query_tile_order(kv_count, batch, heads, heads // k.shape[1], block_q, q_tiles,\n"
             "                                        chosen.causal)\n"
             "        key = (id(kv_count), kv_count._version, order.data_ptr())\n"
             "        if key not in _PROBE_ORDERS:  # (probe) the flag: items' mean keys below the threshold\n"
             "            short = kv_count.expand(batch, heads, -1).float().mean() * block_kv < "
             f"{ALTERNATE_KEYS[way]}\n"
             "            _PROBE_ORDERS.clear()\n"
             "            _PROBE_ORDERS[key] = (kv_count, torch.cat([order, short.to(torch.int32).view(1)]))\n"
             "        tensors[\"ITEM_ORDER\"] = _PROBE_ORDERS[key][1]\n")
    source = _substitute(source, way, [
        (name, new_name), (body, new_body),
        ("    BUFFERS: gl.constexpr = ring[0].shape[0] // 2\n",
         "    ring = shared[1]\n    BUFFERS: gl.constexpr = ring[0].shape[0] // 2\n"),
        (ORDER_CALL, order)])
    # every call of _q_buffer, once its definition has changed
    source = _substitute(source, way, [("_q_buffer(ring, turn", "_q_buffer(shared, turn")], times=4)
    return source + "\n\n_PROBE_ORDERS: dict = {}\n"


def variant(source: str, way: str) -> str:
    """forward_ws.py's source with two Q buffers and way's substitutions."""
    source = _substitute(source, way, [TWO_BUFFERS] + WAYS.get(way, []))
    return runtime_way(source, way) if way in ALTERNATE_KEYS else source


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the copies")
    parser.add_argument("--ways", nargs="+", choices=sorted({**WAYS, **ALTERNATE_KEYS}),
                        default=sorted({**WAYS, **ALTERNATE_KEYS}))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(KERNEL) as f:
        source = f.read()
    for way in args.ways:
        path = os.path.join(args.out, f"forward_ws_{way.replace('-', '_')}.py")
        with open(path, "w") as f:
            f.write(variant(source, way))
        print(path)


if __name__ == "__main__":
    main()
