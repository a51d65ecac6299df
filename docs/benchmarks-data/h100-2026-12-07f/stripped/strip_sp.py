# Run on the H100 as `python3 strip_sp.py --size qwen3-4b --dtype 4bit --small-m-kernel --steps 256
# --json-out FILE` (written into /tmp there, from the repository root at 1217b7e + launch_cost's
# fix): step_profile with small_m_qmm's kernel sources stripped of comments, indentation and
# blank lines, the same tokens in a shorter string (MLX hashes a custom kernel's source each
# time it encodes it).
import re, sys
from mtplxd.engine.model import small_m_qmm as s
def strip(src):
    src = re.sub(r'//[^\n]*', '', src); src = re.sub(r'/\*.*?\*/', '', src, flags=re.S)
    return '\n'.join(l.strip() for l in src.splitlines() if l.strip())
for n in ('_HEADER', '_SOURCE', '_SOURCE_VECTOR', '_SOURCE_MMA', '_SOURCE_MMA_PIPELINED'):
    setattr(s, n, strip(getattr(s, n)))
from mtplxd.engine.bench import step_profile
sys.exit(step_profile.main(sys.argv[1:]))
