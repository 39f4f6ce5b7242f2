#!/usr/bin/env bash
# The Python matrix: for each interpreter, an environment with torch and the test extras, then the test suite.
#
#   tools/pymatrix.sh [VERSION...]          default: 3.10 3.12 3.13 (3.11 is CI's own Python: .ci/run)
#
# 3.10, 3.12 and 3.13 come from pyenv ($(pyenv root)/versions/<version>*). 3.14 comes from Debian's packages: a
# `debootstrap` of sid into $PYMATRIX_ROOT/sid (root and debootstrap needed; the tests then run inside that chroot,
# with the repository bind-mounted at /repo). Each environment is made once and reused ($PYMATRIX_ROOT/py<version>);
# torch is the suite's version ($TORCH, from the package index: on Linux the CUDA build, ~2.7 GB per environment,
# which runs on the CPU as well). PYTEST_ARGS chooses what runs (default: the suite without the slow set; `-m python`
# for the Python-sensitive tests only; add --runslow for everything). Each Python's pytest summary line is appended,
# dated, to $PYMATRIX_RESULTS (default bench/results/pymatrix.txt), its whole log kept beside the environment.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=${PYMATRIX_ROOT:-/work/pymatrix}
TORCH=${TORCH:-2.13.0}
RESULTS=${PYMATRIX_RESULTS:-bench/results/pymatrix.txt}
read -r -a ARGS <<< "${PYTEST_ARGS:--q -p no:cacheprovider}"
mkdir -p "$ROOT" "$(dirname "$RESULTS")"
status=0

pyenv_python() {  # the newest pyenv build of a version: 3.13 -> ~/.pyenv/versions/3.13.x/bin/python
    local base
    base=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
    find "$base/versions" -maxdepth 1 -name "$1.*" 2>/dev/null | sort -V | tail -1 | sed 's|$|/bin/python|'
}

environment() {  # $1: the interpreter, $2: the environment's folder; torch first, then the project with its extras
    local python=$1 venv=$2
    if [ ! -x "$venv/bin/python" ]; then
        "$python" -m venv "$venv" || return 1
    fi
    if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
        local start=$SECONDS
        "$venv/bin/python" -m pip install -q "torch==$TORCH" || return 1
        echo "torch $TORCH for $("$venv/bin/python" -V): $((SECONDS - start)) s"
    fi
    "$venv/bin/python" -m pip install -q -e ".[test]" || return 1
}

record() {  # $1: version, $2: log; the summary line of pytest, dated, with the commit and the interpreter
    local line
    line=$(grep -E "^(=+ )?[0-9]+ (passed|failed)|^(=+ )?no tests ran|error" "$2" | tail -1 | sed 's/=//g; s/^ *//')
    printf '%s  %s  python %s  torch %s  %s  [%s]\n' "$(date -u +%Y-%m-%dT%H:%MZ)" "$(git rev-parse --short HEAD)" \
        "$1" "$TORCH" "${line:-no summary: see $2}" "${ARGS[*]}" | tee -a "$RESULTS"
}

run_pyenv() {
    local version=$1 python venv log
    python=$(pyenv_python "$version")
    if [ -z "$python" ] || [ ! -x "$python" ]; then
        echo "python $version: not in pyenv" | tee -a "$RESULTS"
        return 1
    fi
    venv="$ROOT/py$version"
    log="$ROOT/py$version.log"
    environment "$python" "$venv" || { echo "python $version: environment failed" | tee -a "$RESULTS"; return 1; }
    # the checkout's safetorch, not an installed one; nothing of the caller's SAFETORCH_* settings
    env -u SAFETORCH_STRICT -u SAFETORCH_IGNORE -u SAFETORCH_SELECT -u SAFETORCH_DISABLE -u SAFETORCH_REPORT \
        PYTHONPATH="$PWD" "$venv/bin/python" -m pytest "${ARGS[@]}" > "$log" 2>&1
    local rc=$?
    record "$("$venv/bin/python" -V | cut -d' ' -f2)" "$log"
    return $rc
}

run_sid() {  # 3.14: Debian sid's python3 in a chroot (debootstrap), with its own venv inside
    local target="$ROOT/sid" log="$ROOT/py3.14.log"
    if ! command -v debootstrap > /dev/null || [ "$(id -u)" != 0 ]; then
        echo "python 3.14: needs root and debootstrap (apt-get install debootstrap)" | tee -a "$RESULTS"
        return 1
    fi
    if [ ! -x "$target/usr/bin/python3" ]; then
        debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,git,ca-certificates sid "$target" \
            http://deb.debian.org/debian || return 1
    fi
    mkdir -p "$target/repo"
    mountpoint -q "$target/repo" || mount --bind "$PWD" "$target/repo" || return 1
    mountpoint -q "$target/proc" || mount -t proc proc "$target/proc"
    cp /etc/resolv.conf "$target/etc/resolv.conf"
    # this machine's names: a torchrun job's rendezvous (--standalone) resolves the host's name, which the chroot's
    # own hosts file does not know (every 2-rank job timed out there)
    cp /etc/hosts "$target/etc/hosts"
    # this machine's certificate authorities (a proxy's, where there is one) for pip inside the chroot, which reads
    # the system's bundle (SSL_CERT_FILE and PIP_CERT, inherited, name that path)
    cp /etc/ssl/certs/ca-certificates.crt "$target/etc/ssl/certs/ca-certificates.crt"
    chroot "$target" /bin/bash -c "cd /repo && { [ -x /venv/bin/python ] || python3 -m venv /venv; } &&
        { /venv/bin/python -c 'import torch' 2>/dev/null || /venv/bin/python -m pip install -q 'torch==$TORCH'; } &&
        /venv/bin/python -m pip install -q -e '.[test]' &&
        PYTHONPATH=/repo /venv/bin/python -m pytest ${ARGS[*]}" > "$log" 2>&1
    local rc=$?
    record "$(chroot "$target" /venv/bin/python -V | cut -d' ' -f2)" "$log"
    umount "$target/repo" "$target/proc" 2> /dev/null
    return $rc
}

versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.10 3.12 3.13)
for version in "${versions[@]}"; do
    if [ "$version" = 3.14 ]; then
        run_sid || status=1
    else
        run_pyenv "$version" || status=1
    fi
done
exit $status
