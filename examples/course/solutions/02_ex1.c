/* examples/course/solutions/02_ex1.c - lesson 02, exercise 1: a tensor around every device.

   x starts on device 0 and visits device 1, 2, ..., then comes back to device 0; on each device
   it is doubled there (mgpu_scale on the copy, on that device). In PyTorch:
       for d in devices[1:] + devices[:1]:
           x = x.to(d) * 2
   After n devices every element is x * 2^n: checked in plain C. */
// course-run: cpu:3
// course-run-emu 2: cuda:0,1
// course-expect: ring ok
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>

int main(int argc, char** argv) {
    const float start[4] = { 1, -2, 0.5f, 3 };
    float got[4];
    mgpu_device_set* set = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu:3");
    mgpu_tensor* x;
    int n, i, failures = 0;
    if (!set) { printf("%s\n", mgpu_last_error()); return 1; }
    n = mgpu_device_set_count(set);
    x = mgpu_tensor_create(mgpu_device_set_get(set, 0), MGPU_F32, mgpu_shape1(4));
    if (!x) { printf("%s\n", mgpu_last_error()); return 1; }
    mgpu_tensor_upload(x, start, sizeof start);
    for (i = 1; i <= n; ++i) {
        mgpu_device* next = mgpu_device_set_get(set, i % n);   /* the last step goes back to device 0 */
        mgpu_tensor* moved = mgpu_tensor_to(x, next);           /* x.to(next) */
        if (!moved || mgpu_scale(moved, moved, 2.0f) != MGPU_OK) { printf("%s\n", mgpu_last_error()); return 1; }
        mgpu_tensor_download(moved, got, sizeof got);   /* to show where it is and what it holds */
        printf("on %-8s x[0] = %g\n", mgpu_device_label(next), got[0]);
        mgpu_tensor_destroy(x);
        x = moved;
    }
    mgpu_tensor_download(x, got, sizeof got);
    for (i = 0; i < 4; ++i)
        if (got[i] != start[i] * (float)(1 << n)) { printf("WRONG: x[%d] = %g, want %g\n", i, got[i], start[i] * (1 << n)); failures++; }
    printf("back on %s after %d devices: x[0] = %g (x * 2^%d)\n", mgpu_device_label(mgpu_tensor_device(x)), n, got[0], n);
    if (mgpu_tensor_device(x) != mgpu_device_set_get(set, 0)) { printf("WRONG: not back on device 0\n"); failures++; }
    mgpu_tensor_destroy(x);
    mgpu_device_set_destroy(set);
    if (failures) return 1;
    printf("ring ok\n");
    return 0;
}
