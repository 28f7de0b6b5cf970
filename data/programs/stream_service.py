"""A streaming TTS service loop as web services write one, standing in for a user's program (it imports voxcpm only).

A worker thread runs ``generate_streaming`` and puts each chunk on a queue; the consumer thread (a socket handler in a
real service) takes them. Writes the chunks' float32 bytes to ``--out`` and ``--out``.json: each chunk's arrival
time after the previous one, the first chunk's wait, and the wall time.

    python data/programs/stream_service.py --model-path CKPT --text "..." --out chunks.bin [--seed 0]
"""

import argparse
import json
import queue
import threading
import time


def serve(model, text: str, timesteps: int, out: str) -> dict:
    chunks, done = queue.Queue(maxsize=4), object()

    def worker():
        try:
            for chunk in model.generate_streaming(text=text, inference_timesteps=timesteps):
                chunks.put(chunk)
        finally:
            chunks.put(done)

    start = time.perf_counter()
    threading.Thread(target=worker, daemon=True).start()
    gaps, last = [], start
    with open(out, "wb") as f:
        while (chunk := chunks.get()) is not done:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            f.write(chunk.astype("float32").tobytes())
    return {"first_chunk_s": gaps[0] if gaps else None, "chunk_s": gaps[1:], "chunks": len(gaps),
            "wall_s": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timesteps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=None, help="seed torch first (a service that wants repeatable audio)")
    args = ap.parse_args()
    import torch

    if args.seed is not None:
        torch.manual_seed(args.seed)
    from voxcpm import VoxCPM

    model = VoxCPM(voxcpm_model_path=args.model_path, enable_denoiser=False)  # as a service builds it
    with open(args.out + ".json", "w") as f:
        json.dump(serve(model, args.text, args.timesteps, args.out), f)


if __name__ == "__main__":
    main()
