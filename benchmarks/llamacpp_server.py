"""llama.cpp's own HTTP server from the `xllamacpp` wheel, as a process of its own (run by the peers venv's
Python, never imported by pagedserve): serves until SIGTERM / SIGINT.

    python llamacpp_server.py --model FILE.gguf --port P --parallel N [--threads 2] [--ctx-per-slot 1024] [--alias NAME]
        [--yarn-factor F --yarn-orig-ctx N] [--embedding last|mean|cls]
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a .gguf file")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parallel", type=int, default=1, help="slots: requests decoded together")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx-per-slot", type=int, default=1024, help="context tokens per slot")
    parser.add_argument(
        "--poll",
        type=int,
        default=None,
        help="how hard its threads spin waiting for work, 0-100 (llama.cpp's default: 50)",
    )
    parser.add_argument("--alias", default=None, help="the model name clients send and responses carry")
    parser.add_argument(
        "--embedding",
        choices=("last", "mean", "cls"),
        default=None,
        help="serve /v1/embeddings with this pooling (vectors L2-normalized), not generation",
    )
    parser.add_argument("--yarn-factor", type=float, default=None, help="YaRN rope scaling by this factor")
    parser.add_argument("--yarn-orig-ctx", type=int, default=0, help="with --yarn-factor: the trained context")
    args = parser.parse_args()

    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.n_parallel = args.parallel
    params.n_ctx = args.ctx_per_slot * args.parallel
    params.cont_batching = True
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    if args.poll is not None:
        params.cpuparams.poll = args.poll
        params.cpuparams_batch.poll = args.poll
    if args.embedding:
        params.embedding = True
        params.pooling_type = getattr(xllamacpp.llama_pooling_type, f"LLAMA_POOLING_TYPE_{args.embedding.upper()}")
        params.n_batch = params.n_ubatch = args.ctx_per_slot  # an input is embedded in one batch: it must fit
    if args.yarn_factor:
        params.rope_scaling_type = xllamacpp.llama_rope_scaling_type.LLAMA_ROPE_SCALING_TYPE_YARN
        params.rope_freq_scale = 1.0 / args.yarn_factor
        params.yarn_orig_ctx = args.yarn_orig_ctx
    params.port = args.port
    params.hostnames = ["127.0.0.1"]
    if args.alias:
        params.model_alias = {args.alias}
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server = xllamacpp.Server(params)  # serves HTTP on its own threads while this process lives
    print(
        f"llama.cpp server (xllamacpp {getattr(xllamacpp, '__version__', '?')}) on 127.0.0.1:{args.port}, "
        f"{args.parallel} slots",
        flush=True,
    )
    stop.wait()
    del server
    return 0


if __name__ == "__main__":
    sys.exit(main())
