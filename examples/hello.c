/* hello.c - the smallest mgpu program: pick a device, multiply two matrices, print the result.
   CPU only:  cc -std=c99 hello.c -I.. -lm -lpthread
   With CUDA: see the top of mgpu.h. */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>

int main(void) {
    float a[2 * 3] = { 1, 2, 3, 4, 5, 6 }, b[3 * 2] = { 1, 0, 0, 1, 1, 1 }, c[2 * 2];
    mgpu_device_set* set = mgpu_device_set_create("auto");   /* every GPU, or the CPU */
    mgpu_device* dev;
    mgpu_tensor *ta, *tb, *tc;
    if (!set) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
    dev = mgpu_device_set_get(set, 0);
    ta = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(2, 3));
    tb = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(3, 2));
    tc = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(2, 2));
    if (!ta || !tb || !tc || mgpu_tensor_upload(ta, a, sizeof a) || mgpu_tensor_upload(tb, b, sizeof b) ||
        mgpu_matmul(tc, ta, tb, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f) || mgpu_tensor_download(tc, c, sizeof c)) {
        fprintf(stderr, "%s\n", mgpu_last_error());
        return 1;
    }
    printf("on %s: [[%g, %g], [%g, %g]]\n", mgpu_device_label(dev), c[0], c[1], c[2], c[3]);
    mgpu_tensor_destroy(ta);
    mgpu_tensor_destroy(tb);
    mgpu_tensor_destroy(tc);
    mgpu_device_set_destroy(set);
    return 0;
}
