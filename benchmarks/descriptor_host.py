"""Host time of launches that take tensor descriptors, with the plans' kept tensor maps (launch.EXPAND_DESCRIPTORS,
the default) and without (Triton's launcher encodes every map on every launch), alternating in one process: B8 H16
D128 bf16, 128x128 blocks, d=0.5, eager forward and forward+backward (autograd's default device thread, and the
calling thread). At S=1024 the descriptor-work floor is lowered (tma.MIN_DESCRIPTOR_WORK = 0), so the
warp-specialized kernels run there too; do_bench of the calling-thread forward+backward says whether the call is
still host-bound.

    python benchmarks/descriptor_host.py [--seq 1024 2048 4096] [--rounds 3]
"""

import argparse

import triton.testing

from blockattn.kernels import launch, tma

from exp_short import calling_thread, short_case
from host_cost import per_call_us


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    floor = tma.MIN_DESCRIPTOR_WORK
    for seq in args.seq:
        tma.MIN_DESCRIPTOR_WORK = 0 if seq <= 1024 else floor
        fwd, fwd_bwd = short_case(8, 16, seq, 0.5)
        on_calling = calling_thread(fwd_bwd)
        for _ in range(5):
            fwd(), fwd_bwd(), on_calling()
        for _ in range(args.rounds):
            for expand in (True, False):
                launch.EXPAND_DESCRIPTORS = expand
                times = [per_call_us(fn, 60) for fn in (fwd, fwd_bwd, on_calling)]
                gpu_bound = triton.testing.do_bench(on_calling, warmup=25, rep=100, return_mode="median")
                print(f"S{seq} kept maps={expand}: host us a call: forward {times[0]:.1f}, forward+backward "
                      f"{times[1]:.1f}, on the calling thread {times[2]:.1f} (do_bench of that {gpu_bound:.3f} ms)",
                      flush=True)
    launch.EXPAND_DESCRIPTORS = True
    tma.MIN_DESCRIPTOR_WORK = floor


if __name__ == "__main__":
    main()
