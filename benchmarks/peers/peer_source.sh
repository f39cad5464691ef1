# Sourced by the build_<peer>.sh scripts: where a peer's source comes from and where it may be built.

# refuse_inside_repo NAME BUILD REPO: a peer is never built inside this repository.
refuse_inside_repo() {
    case "$(realpath -m "$2")/" in
    "$3"/*) echo "$1: PEERS_DIR must lie outside the repository ($3)" >&2; exit 2 ;;
    esac
}

# git_dir SOURCE BUILD: a git directory holding SOURCE's commits. git archive reads a local git
# directory (bare or not) at any commit; a URL is cloned bare into BUILD first (needs network).
git_dir() {
    if git --git-dir="$1" rev-parse --git-dir >/dev/null 2>&1; then
        echo "$1"
    elif git -C "$1" rev-parse --git-dir >/dev/null 2>&1; then
        git -C "$1" rev-parse --absolute-git-dir
    else
        git clone --quiet --bare "$1" "$2/clone.git" && echo "$2/clone.git"
    fi
}
