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
            barriers' initialization and about 130 lines that ptxas orders otherwise)

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


def variant(source: str, way: str) -> str:
    """forward_ws.py's source with two Q buffers and way's substitutions."""
    for old, new in [TWO_BUFFERS] + WAYS[way]:
        if source.count(old) != 1:
            raise ValueError(f"way {way!r}: {old.strip()!r} occurs {source.count(old)} times in forward_ws.py, "
                             "expected once")
        source = source.replace(old, new)
    return source


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the copies")
    parser.add_argument("--ways", nargs="+", choices=sorted(WAYS), default=sorted(WAYS))
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
