"""scripts/train.py, but rank 1 SIGKILLs itself before global step $DTAPE_TEST_KILL_AT_STEP on torchrun's first attempt.

For the restart test: `torchrun --max-restarts 1` restarts every worker and
train.py --resume continues from the last checkpoint.
"""
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "scripts"))
import train  # noqa: E402

KILL_AT = int(os.environ["DTAPE_TEST_KILL_AT_STEP"])
_make_train_step = train.Trainer._make_train_step


def _make_killing_step(self):
    step = _make_train_step(self)

    def killing_step(batch):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and os.environ["RANK"] == "1" and self.step == KILL_AT:
            time.sleep(1.0)   # rank 0 is blocked in this step's collectives by now
            os.kill(os.getpid(), signal.SIGKILL)
        return step(batch)
    return killing_step


train.Trainer._make_train_step = _make_killing_step
train.main()
