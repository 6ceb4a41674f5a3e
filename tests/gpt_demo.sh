#!/bin/sh
# build/gpt's demo: a byte-level GPT (4 blocks, 4 heads, width 128, T 64, batch 16, AdamW at 0.003
# with the gradients' norm clipped to 1.0, GPT-2's recipe: without the clip this learning rate
# trains unsteadily, the loss rising between steps 300 and 600 and the end depending on the last
# bits of the sums: validation 2.22 or 2.47 nats per byte from two builds that differ only in
# rounding, 2.06 with the clip) trained
# on a real text corpus from a Debian package (fortunes' cookie file, 245 kB) on the CPU, then
# samples. It must bring the validation loss (the held-out tenth of the file) below 2.3 nats per
# byte and print a sample; the seconds it took are printed, not checked (a loaded machine is
# slower). Without the fortunes package, one skip. Usage: gpt_demo.sh [BUILD_DIR]
b=${1:-build}
text=/usr/share/games/fortunes/cookie
if [ ! -e "$text" ]; then
    echo "  skip the GPT demo: no $text (apt-get install fortunes)"
    echo "0 passed, 0 failed, 1 skipped"
    exit 0
fi
out=$("$b/gpt" --text "$text" --steps 2100 --every 300 --lr 0.003 --clip 1.0 --devices cpu --sample 200 2>&1)
rc=$?
echo "$out" | sed 's/^/  | /'
passed=0; failed=0
last=$(echo "$out" | tail -n 1)
val=$(echo "$last" | sed -n 's/.*val_loss=\([0-9.]*\).*/\1/p')
if [ $rc -eq 0 ] && [ -n "$val" ] && awk -v v="$val" 'BEGIN { exit !(v < 2.3) }'; then
    passed=$((passed + 1)); echo "  ok   the demo's validation loss $val < 2.3 nats per byte ($last)"
else
    failed=$((failed + 1)); echo "  FAIL the demo's validation loss '$val' (exit $rc), want below 2.3"
fi
if echo "$out" | grep -q -- '---- sample ----'; then
    passed=$((passed + 1)); echo "  ok   the demo prints a sample"
else
    failed=$((failed + 1)); echo "  FAIL the demo printed no sample"
fi
# the same run in bf16 mixed precision (--precision bf16): the same bar (about 2x slower on the CPU,
# whose bf16 products are a reference: widened to f32)
out=$("$b/gpt" --text "$text" --steps 2100 --every 700 --lr 0.003 --clip 1.0 --devices cpu --sample 0 --precision bf16 2>&1)
rc=$?
last=$(echo "$out" | tail -n 1)
val=$(echo "$last" | sed -n 's/.*val_loss=\([0-9.]*\).*/\1/p')
if [ $rc -eq 0 ] && [ -n "$val" ] && awk -v v="$val" 'BEGIN { exit !(v < 2.3) }'; then
    passed=$((passed + 1)); echo "  ok   the demo in bf16: validation loss $val < 2.3 nats per byte ($last)"
else
    failed=$((failed + 1)); echo "  FAIL the demo in bf16: validation loss '$val' (exit $rc), want below 2.3"; echo "$out" | tail -n 3 | sed 's/^/  | /'
fi
echo "$passed passed, $failed failed, 0 skipped"
[ $failed -eq 0 ]
