#!/usr/bin/env bash
# The variable reference in each role's README, generated from the role's meta/argument_specs.yml.
#   tools/role_docs.sh          rewrite roles/*/README.md in place (make docs)
#   tools/role_docs.sh --check  render into a temporary copy and fail with the diff where a README is not
#                               current; changes nothing (make lint)
# aar-doc (pinned in requirements.txt) renders tools/role_variables.md.j2 between the lines
# <!-- BEGIN_ANSIBLE_DOCS --> and <!-- END_ANSIBLE_DOCS --> and leaves the rest of the README as it is.
# Every role with a meta/argument_specs.yml is covered: a README without the markers gets them appended,
# a role without a README gets one that holds only the reference. A second run changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

begin='<!-- BEGIN_ANSIBLE_DOCS -->'
end='<!-- END_ANSIBLE_DOCS -->'
template=$PWD/tools/role_variables.md.j2
aar_doc=${AAR_DOC:-aar-doc}

case ${1:-} in
  "") check=false ;;
  --check) check=true ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac
# aar-doc takes a --output-template that is not a file as the template text itself: make sure it is one.
[[ -f $template ]] || { echo "$0: $template is missing" >&2; exit 1; }

if $check; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
else
  out=$PWD
fi

stale=()
for spec in roles/*/meta/argument_specs.yml; do
  role=${spec%/meta/argument_specs.yml}
  readme=$out/$role/README.md
  if $check; then
    mkdir -p "$out/$role"
    if [[ -f $role/README.md ]]; then cp "$role/README.md" "$readme"; fi
  fi
  if [[ -f $readme ]] && ! grep -qxF "$begin" "$readme"; then
    printf '\n%s\n%s\n' "$begin" "$end" >>"$readme"
  fi
  # aar-doc reports an unreadable argument_specs.yml on stdout and goes on with no arguments: any output
  # is a failure here, so that a broken spec never empties a README's reference.
  said=$("$aar_doc" --output-mode inject --output-template "$template" --output-file "$readme" "$role" markdown 2>&1) || {
    echo "$role: aar-doc failed: $said" >&2; exit 1; }
  if [[ -n $said ]]; then echo "$role: $said" >&2; exit 1; fi
  if $check && ! diff -u --label "$role/README.md" --label "$role/README.md (make docs)" \
      "$([[ -f $role/README.md ]] && echo "$role/README.md" || echo /dev/null)" "$readme"; then
    stale+=("$role/README.md")
  fi
done

if ((${#stale[@]})); then
  echo "Not current with meta/argument_specs.yml: ${stale[*]}. Run 'make docs' and commit the result." >&2
  exit 1
fi
