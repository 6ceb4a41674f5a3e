#!/bin/sh
# build/train refuses bad flags before it trains: a non-zero exit and a message that names the
# flag. Out-of-range numbers (not truncated), --lr 0/inf/nan, a negative --weight-decay (0 is
# legal), a malformed --devices without a GPU, a --save path that cannot be written; and a
# checkpoint whose step count is past every epoch resumes as finished instead of looping; --verbose
# prints each replica's rows, loss and bytes all-reduced, and they add up.
# Usage: train_flags.sh [TRAIN_BINARY] [DATA_DIR]
train=${1:-build/train}
data=${2:-/usr/share/datasets/fashion-mnist}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0; failed=0; skipped=0
ok() { passed=$((passed + 1)); echo "  ok   $1"; }
bad() { failed=$((failed + 1)); echo "  FAIL $1"; [ -s "$tmp/err" ] && sed 's/^/       /' "$tmp/err" | tail -n 3; }

# refused FLAG VALUE...: train, given the arguments after FLAG, exits 2 naming FLAG, within 30 s
# (it must fail while parsing, before any data is read or training starts)
refused() {
    flag=$1; shift
    timeout 30 "$train" --data "$tmp/nowhere" --quiet "$@" >/dev/null 2>"$tmp/err"; rc=$?
    if [ $rc -eq 2 ] && grep -q -e "$flag" "$tmp/err"; then ok "refused: $* (exit 2, names $flag)"
    else bad "refused: $* (exit $rc, want 2 and a message naming $flag)"; fi
}
refused --epochs --epochs 99999999999
refused --epochs --epochs 4294967297
refused --epochs --epochs 0
refused --epochs --epochs 1.5
refused --batch --batch 99999999999
refused --batch --batch -64
refused --max-steps --max-steps -1
refused --max-steps --max-steps 99999999999999999999
refused --seed --seed -1
refused --seed --seed 99999999999999999999
refused --lr --lr 0
refused --lr --lr -0.1
refused --lr --lr inf
refused --lr --lr nan
refused --lr --lr 1e40
refused --lr --lr 0.1x
refused --weight-decay --weight-decay -1
refused --weight-decay --weight-decay nan
refused --weight-decay --weight-decay inf
refused --momentum --momentum 1
refused --momentum --momentum nan
refused --std --std 0
refused --std --std -0.5
refused --mean --mean nan
refused --mean --mean 0.1x
refused --devices --devices cuda:0,,1
refused --devices --devices cuda:
refused --devices --devices cpu:0
refused --save --save "$tmp/no/such/folder/model.safetensors"
mkdir "$tmp/adir"
refused --save --save "$tmp/adir"
if mkfifo "$tmp/fifo" 2>/dev/null; then refused --save --save "$tmp/fifo"
else skipped=$((skipped + 1)); echo "  skip --save onto a FIFO: mkfifo failed"; fi
ln -s "$tmp/adir" "$tmp/link-to-dir"
refused --save --save "$tmp/link-to-dir"
if [ "$(id -u)" -ne 0 ]; then
    mkdir "$tmp/ro" && chmod 555 "$tmp/ro"
    refused --save --save "$tmp/ro/model.safetensors"
    chmod 755 "$tmp/ro"
else
    skipped=$((skipped + 1)); echo "  skip --save into a read-only folder: running as root (permissions do not apply)"
fi

# legal values get past the flags: the run fails only for the missing data
accepted() {
    timeout 30 "$train" --data "$tmp/nowhere" --quiet --devices cpu "$@" >/dev/null 2>"$tmp/err"; rc=$?
    if grep -q "Fashion-MNIST not found" "$tmp/err"; then ok "accepted: $*"
    else bad "accepted: $* (exit $rc, the message is not about the missing data)"; fi
}
accepted --weight-decay 0
accepted --lr 1e-6 --weight-decay 0.5 --momentum 0
accepted --epochs 1000000 --max-steps 9007199254740992 --seed 18446744073709551615
accepted --save "$tmp/model.safetensors"
accepted --save model-in-cwd.safetensors
accepted --mean 0 --std 1 --momentum 0 --schedule constant --lr 0.01

# the tutorial's inputs, ToTensor() alone: --mean 0 --std 1 trains on pixel / 255 and says so
if [ -e "$data/train-images-idx3-ubyte.gz" ] || [ -e "$data/train-images-idx3-ubyte" ]; then
    timeout 120 "$train" --data "$data" --quiet --devices cpu --max-steps 20 --mean 0 --std 1 --save "$tmp/raw.safetensors" \
        > "$tmp/raw.txt" 2>"$tmp/err"
    timeout 120 "$train" --data "$data" --quiet --devices cpu --max-steps 20 > "$tmp/normed.txt" 2>>"$tmp/err"
    loss_raw=$(tail -n 1 "$tmp/raw.txt" | tr ' ' '\n' | sed -n 's/^train_loss=//p')
    loss_normed=$(tail -n 1 "$tmp/normed.txt" | tr ' ' '\n' | sed -n 's/^train_loss=//p')
    if [ -n "$loss_raw" ] && [ -n "$loss_normed" ] && [ "$loss_raw" != "$loss_normed" ] &&
       head -c 4096 "$tmp/raw.safetensors" | grep -a -q '"input.mean":"0.0000","input.std":"1.0000"'; then
        ok "--mean 0 --std 1: another training (loss $loss_raw, normalised $loss_normed), and the checkpoint says so"
    else
        bad "--mean 0 --std 1: losses '$loss_raw' and '$loss_normed', metadata: $(head -c 4096 "$tmp/raw.safetensors" | tr ',' '\n' | grep -a input.mean)"
    fi
else
    skipped=$((skipped + 1)); echo "  skip --mean 0 --std 1: no Fashion-MNIST in $data"
fi

# --verbose: a line per replica with each progress line and at the end, whose numbers add up: the
# replicas' rows of a step make the batch (50 on 3 replicas: 17, 17, 16), each all-reduced the same
# bytes, and since the start their rows make steps x batch; without it, no such line
if [ -e "$data/train-images-idx3-ubyte.gz" ] || [ -e "$data/train-images-idx3-ubyte" ]; then
    timeout 120 "$train" --data "$data" --devices cpu:3 --epochs 1 --batch 50 --max-steps 3 --verbose > "$tmp/verbose.txt" 2>"$tmp/err"
    timeout 120 "$train" --data "$data" --devices cpu:3 --epochs 1 --batch 50 --max-steps 3 > "$tmp/plain.txt" 2>>"$tmp/err"
    check=$(grep '^  replica [0-9]* on ' "$tmp/verbose.txt" | tail -n 3 | awk -F' [|] ' '
        { split($1, a, " "); split($2, b, " ")
          for (i = 1; i in a; ++i) if (split(a[i], kv, "=") == 2) step_[kv[1]] = kv[2]
          for (i = 1; i in b; ++i) if (split(b[i], kv, "=") == 2) all_[kv[1]] = kv[2]
          if (n == 0) { step = a[6]; ar = step_["allreduced"] }
          if (step_["allreduced"] != ar || a[6] != step || !(step_["loss"] + 0 > 0)) odd = "inconsistent"
          n++; rows += step_["rows"]; all += all_["rows"] }
        END { printf "%d %d %d %s %s", n, rows, all, ar, odd }')
    set -- $check
    if [ "$1" = 3 ] && [ "$2" = 50 ] && [ "$3" = 150 ] && [ "${4:-0}" -gt 0 ] && [ -z "$5" ] &&
       ! grep -q '^  replica ' "$tmp/plain.txt" && [ "$(tail -n 1 "$tmp/plain.txt" | sed 's/samples_per_s=.*//')" = \
       "$(tail -n 1 "$tmp/verbose.txt" | sed 's/samples_per_s=.*//')" ]; then
        ok "--verbose: 3 replicas, rows $2 of a batch of 50, $3 of 3 steps, $4 bytes all-reduced each; none without it"
    else
        bad "--verbose: replicas $1, rows $2 (want 50), since the start $3 (want 150), all-reduced $4, ${5:-consistent}"
        grep '^  replica' "$tmp/verbose.txt" | tail -n 3 | sed 's/^/       /'
    fi
else
    skipped=$((skipped + 1)); echo "  skip --verbose: no Fashion-MNIST in $data"
fi

# a checkpoint claiming 2^53 steps: every epoch is done, so train evaluates and stops
if [ ! -e "$data/train-images-idx3-ubyte.gz" ] && [ ! -e "$data/train-images-idx3-ubyte" ]; then
    skipped=$((skipped + 1)); echo "  skip resuming from a huge step count: no Fashion-MNIST in $data"
elif ! command -v python3 >/dev/null 2>&1; then
    skipped=$((skipped + 1)); echo "  skip resuming from a huge step count: no python3 to edit the checkpoint"
else
    timeout 120 "$train" --data "$data" --quiet --devices cpu --epochs 1 --max-steps 2 --save "$tmp/c.safetensors" >/dev/null 2>"$tmp/err"
    python3 - "$tmp/c.safetensors" <<'EOF'
import json, struct, sys
p = sys.argv[1]
b = open(p, "rb").read()
n = struct.unpack("<Q", b[:8])[0]
h = json.loads(b[8:8 + n])
h["__metadata__"]["mgpu.step"] = str(2 ** 53)
t = json.dumps(h, separators=(",", ":")).encode()
t += b" " * (-len(t) % 8)
open(p, "wb").write(struct.pack("<Q", len(t)) + t + b[8 + n:])
EOF
    out=$(timeout 60 "$train" --data "$data" --quiet --devices cpu --epochs 3 --load "$tmp/c.safetensors" 2>"$tmp/err"); rc=$?
    if [ $rc -eq 0 ] && echo "$out" | tail -n 1 | grep -q "steps=9007199254740992 "; then ok "a checkpoint at step 2^53 resumes as finished"
    else bad "a checkpoint at step 2^53 (exit $rc: $(echo "$out" | tail -n 1))"; fi
fi
echo "$passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ]
