# Sourced by scripts/demo and scripts/test: system packages and the project's virtualenv.
# Works on a fresh Debian 12 with Python 3.11, as root or with sudo.

apt_install() {
    local missing=()
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    local sudo=()
    [ "$(id -u)" -ne 0 ] && sudo=(sudo)
    echo "installing Debian packages: ${missing[*]}" >&2
    "${sudo[@]}" apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q "${missing[@]}" >/dev/null
}

# make_venv LOCK [VENV]: VENV (default .venv) holding exactly the versions LOCK pins (a file in
# requirements/, with hashes: pip refuses anything else), then vpool itself, editable, built by
# the locked setuptools (no build isolation: nothing unpinned is fetched to build it).
make_venv() {
    local lock=$1 venv=${2:-.venv} python=${PYTHON:-python3}
    if ! "$python" -c 'import venv, ensurepip' 2>/dev/null; then
        apt_install python3-venv
    fi
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    local pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
    "${pip[@]}" --require-hashes -r "$lock"
    "${pip[@]}" --no-deps --no-build-isolation -e .
}
