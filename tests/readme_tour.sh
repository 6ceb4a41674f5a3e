#!/bin/sh
# The tour in docs/guide.md is examples/tour.c, character for character (the file is what CI
# compiles and runs; this keeps the copy a reader sees from drifting).
guide=$(awk '/^## A short tour/{t=1} t&&/^```c$/{c=1;next} c&&/^```$/{exit} c' docs/guide.md)
if [ -n "$guide" ] && [ "$guide" = "$(cat examples/tour.c)" ]; then exit 0; fi
echo "docs/guide.md's tour differs from examples/tour.c:" >&2
printf '%s\n' "$guide" | diff - examples/tour.c >&2
exit 1
