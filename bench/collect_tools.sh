#!/usr/bin/env bash
# Fill .tools/ (repository root, ignored by git) with iproute2's `ip` and `tc` and the shared
# libraries they need beyond glibc, for a GPU machine that has no iproute2 (bench/run_train_gpu.sh
# puts .tools/bin first on PATH). Run from the repository root on a Debian/Ubuntu machine that has
# iproute2:
#
#     bash bench/collect_tools.sh            # then carry .tools with the device run
#
# .tools/bin/ip and .tools/bin/tc are wrappers: they run the real binaries (.tools/libexec) with
# LD_LIBRARY_PATH=.tools/lib, and `ip netns exec NS CMD` runs CMD with the caller's own
# LD_LIBRARY_PATH, so the copied libraries never reach Python or CUDA processes.
set -euo pipefail
DEST=${1:-.tools}
mkdir -p "$DEST/bin" "$DEST/libexec" "$DEST/lib"
for t in ip tc; do
  src=$(command -v "$t" || true)
  [ -n "$src" ] || { echo "collect_tools: '$t' not found (apt-get install iproute2)" >&2; exit 1; }
  cp -L "$src" "$DEST/libexec/$t"
done
# every library ldd resolves, except glibc's own (the target machine has those)
ldd "$DEST/libexec/ip" "$DEST/libexec/tc" | awk '/=>/ && $3 ~ /^\// {print $3}' | sort -u |
while read -r lib; do
  case $(basename "$lib") in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*) continue ;;
  esac
  cp -L "$lib" "$DEST/lib/"
done
for t in ip tc; do
  cat > "$DEST/bin/$t" <<'WRAP'
#!/usr/bin/env bash
here=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
tool=$(basename "$0")
orig=${LD_LIBRARY_PATH-}
export LD_LIBRARY_PATH="$here/lib${orig:+:$orig}"
if [ "$tool" = ip ] && [ "${1-}" = netns ] && [ "${2-}" = exec ] && [ $# -ge 4 ]; then
  ns=$3; shift 3
  exec "$here/libexec/ip" netns exec "$ns" env "LD_LIBRARY_PATH=$orig" "$@"
fi
exec "$here/libexec/$tool" "$@"
WRAP
  chmod +x "$DEST/bin/$t"
done
# keep .tools/ out of git (the main repository's exclude file also serves its worktrees)
if exclude="$(git rev-parse --git-common-dir 2>/dev/null)/info/exclude"; then
  mkdir -p "$(dirname "$exclude")"
  grep -qxF '/.tools/' "$exclude" 2>/dev/null || echo '/.tools/' >> "$exclude"
fi
du -sh "$DEST"; ls "$DEST"/*
PATH="$PWD/$DEST/bin:$PATH" ip -V && PATH="$PWD/$DEST/bin:$PATH" tc -V
