#!/bin/sh
# The README's tour is examples/tour.c, character for character (the file is what CI compiles
# and runs; this keeps the copy a reader sees from drifting).
readme=$(awk '/^## A short tour/{t=1} t&&/^```c$/{c=1;next} c&&/^```$/{exit} c' README.md)
if [ "$readme" = "$(cat examples/tour.c)" ]; then exit 0; fi
echo "README.md's tour differs from examples/tour.c:" >&2
printf '%s\n' "$readme" | diff - examples/tour.c >&2
exit 1
