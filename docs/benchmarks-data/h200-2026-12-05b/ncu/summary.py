"""Each profiled matmul kernel of an ncu log, one line: duration, DRAM throughput, occupancy,
registers (the probe's small kernels and the quantize kernels left out by their grid).
Reads .log or .log.gz; bench.read_ceiling's readers too."""
import gzip, re, sys
for f in sys.argv[1:]:
    print('==', f)
    for b in re.split(r'\n  (?=\S)', (gzip.open if f.endswith('.gz') else open)(f, 'rt').read()):
        head = b.split('\n')[0]
        if 'affine_quantize' in head or not re.search(r'qmv|qmm|gemv|small_m|read_ceiling', head):
            continue
        m = re.search(r'Duration\s+(\S+)\s+([\d.,]+)', b)
        grid = re.search(r'\((\d+), \d+, \d+\)x\((\d+), (\d+), \d+\)', head)
        if not m or not grid or int(grid.group(1)) < 30:
            continue
        dur = float(m.group(2).replace(',', '')) * (1000 if m.group(1) == 'ms' else 1)
        g = lambda k: (re.search(k + r'\s+\S+\s+([\d.,]+)', b) or [None, '?'])[1]
        name = re.sub(r'\(const.*', '', head.strip())[:70]
        print(f"{dur:8.1f} us  DRAM {g('DRAM Throughput'):>6}%  occupancy {g('Achieved Occupancy'):>6} of "
              f"{g('Theoretical Occupancy'):>5}%  regs {g('Registers Per Thread'):>4}  grid {grid.group(1)} blocks x {int(grid.group(2)) * int(grid.group(3))} threads  {name}")
