"""The `pipekit train` application: from a command line to a trained, saved model.

    start.py      the command: resolve the run, refuse what cannot run, launch or train
    launch.py     workers through torch.distributed.run; signals, restarts, failure reports
    loop.py       one worker's run: build the model, the steps, evaluation, saving
    preflight.py  the paths a run names (data, out_dir, the checkpoint to resume), before launch
    rundirs.py    which live run owns a directory; the lock files; what a refused run leaves
    resume.py     the checkpoint lifecycle: where a run resumes from, saving, pruning
    metrics.py    the progress bar, metrics.jsonl, TensorBoard, the summary table
    generate.py   sampling text from a saved model or checkpoint
    env.py        `pipekit env`: versions and usable backends
"""

from .loop import StopRequests, build, partition_of, train

__all__ = ["train", "build", "partition_of", "StopRequests"]
