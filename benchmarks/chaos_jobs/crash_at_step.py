"""A job with a bug: at its 5th step a worker raises ``RuntimeError``.

``--who one``: only the highest rank of a group of two or more (rank 0 and a
job left alone never crash; a replacement that joins crashes again at its own
5th step); ``--who all``: every worker."""

from __future__ import annotations

import argparse

from train import fault, parse, train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--who", choices=["one", "all"], default="one")
    who = ap.parse_known_args()[0].who

    def before_step(job, ran: int) -> None:
        if ran == 5 and (who == "all" or (job.world_size > 1 and job.rank == job.world_size - 1)):
            fault(f"{job.worker_id} raises at step {job.step_count}")
            raise RuntimeError(f"chaos: the loss exploded at step {job.step_count}")

    train(parse(), before_step)  # parse() leaves --who alone


if __name__ == "__main__":
    main()
