"""One case of tests/call/test_agreement.py on ranks started by a launcher (mpirun, torchrun): every rank prints what
it saw.    mpirun -n 4 python tests/scripts/disagree.py "data_parallel slice of another width"
"""

import sys

import torch.distributed as dist

import shardfn as sf
from tests.call.test_agreement import _run_case

sf.init()
kind, message, seconds = _run_case(sys.argv[1])
print(f"rank {dist.get_rank()}: {kind} after {seconds:.2f} s: {message.splitlines()[0] if message else ''}",
      flush=True)
