#!/usr/bin/env bash
# Run a (multi-process) command; if it is still running after SECONDS, print every thread's Python stack of
# each of its processes (SIGUSR2: `lorafusion train` and scripts/bench_train.py install faulthandler for it),
# then stop it. Exit status: the command's, or 124 after a stack dump. For hangs on the GPU machines:
#   bash scripts/device/watch.sh 300 python3 -m torch.distributed.run --nproc_per_node 2 -m lorafusion.cli train ...
set -u
secs=$1; shift
"$@" &
pid=$!
for ((i = 0; i < secs; i++)); do
  kill -0 "$pid" 2>/dev/null || { wait "$pid"; exit $?; }
  sleep 1
done
descendants() { local c; for c in $(pgrep -P "$1"); do echo "$c"; descendants "$c"; done; }
echo "=== watch.sh: still running after ${secs}s; stacks of every process under $pid ===" >&2
for p in $(descendants "$pid"); do
  # only processes that installed the handler (the default action of SIGUSR2 would end the others)
  if grep -q "lorafusion.cli\|bench_train\|bench_tp_overlap" "/proc/$p/cmdline" 2>/dev/null && ! grep -q "torch.distributed.run" "/proc/$p/cmdline"; then
    echo "--- pid $p: $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-160)" >&2
    kill -USR2 "$p" 2>/dev/null
    sleep 2
    # the native frames too where a tool for them is installed (a host stuck in a CUDA or NCCL call)
    if command -v py-spy >/dev/null; then
      timeout 30 py-spy dump --native --pid "$p" >&2 2>&1
    elif command -v gdb >/dev/null; then
      timeout 60 gdb -p "$p" -batch -ex "thread apply all bt 8" 2>/dev/null | grep -E "^Thread|^#" >&2
    fi
  fi
done
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv >&2
kill -TERM -- "$pid" 2>/dev/null; sleep 5; pkill -KILL -P "$pid" 2>/dev/null; kill -KILL "$pid" 2>/dev/null
exit 124
