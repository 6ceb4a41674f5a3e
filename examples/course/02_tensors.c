/* examples/course/02_tensors.c - lesson 02: tensors live on a device; copies move them.

   In PyTorch, x.to(device), x.cuda() and x.cpu() give a copy on another device, and an op on
   tensors of two devices fails ("Expected all tensors to be on the same device"). mgpu is the
   same, spelled in C:
     mgpu_tensor_create(dev, ...)        torch.empty(..., device=dev)
     mgpu_tensor_upload / _download      torch.tensor(host_list) / t.tolist()
     mgpu_tensor_to(t, dev)              t.to(dev): a new tensor
     mgpu_tensor_copy(dst, src)          dst.copy_(src): into a tensor you have, across devices
   and an op given tensors of two devices fails with MGPU_ERROR_DEVICE_MISMATCH. The two CPU
   devices of "cpu:2" are kept apart exactly as two GPUs are, so a mistake shows on a laptop.

   This program takes a set of at least two devices, moves a tensor from device 0 to device 1,
   computes there, brings the result back to the CPU, checks every number against plain C, then
   makes the mistake on purpose and checks the error.

   Run:   ./02_tensors cpu:2
          MGPU_EMU_DEVICES=2 build/emu/02_tensors cuda:0,1 */
// course-run: cpu:2
// course-run-emu 2: cuda:0,1
// course-expect: are on different devices
// course-expect: tensors ok
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <string.h>

#define N 6
static int failures = 0;
static void check(int ok, const char* what) {
    if (!ok) { printf("WRONG: %s\n", what); failures++; }
}

int main(int argc, char** argv) {
    const float xs[N] = { 1, 2, 3, 4, 5, 6 }, ws[N] = { 0.5f, -1, 2, 0, 3, -2 };
    float got[N];
    mgpu_device_set* set = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu:2");
    mgpu_device *d0, *d1;
    mgpu_tensor *x0, *w1, *x1, *y1, *ycpu;
    char text[64];
    int i;
    if (!set) { printf("%s\n", mgpu_last_error()); return 1; }
    if (mgpu_device_set_count(set) < 2) { printf("this lesson wants two devices, e.g. cpu:2 or cuda:0,1\n"); return 1; }
    d0 = mgpu_device_set_get(set, 0);
    d1 = mgpu_device_set_get(set, 1);

    /* x on device 0, w on device 1: torch.tensor(xs, device=d0), torch.tensor(ws, device=d1) */
    x0 = mgpu_tensor_create(d0, MGPU_F32, mgpu_shape1(N));
    w1 = mgpu_tensor_create(d1, MGPU_F32, mgpu_shape1(N));
    y1 = mgpu_tensor_create(d1, MGPU_F32, mgpu_shape1(N));
    if (!x0 || !w1 || !y1) { printf("%s\n", mgpu_last_error()); return 1; }
    mgpu_tensor_upload(x0, xs, sizeof xs);
    mgpu_tensor_upload(w1, ws, sizeof ws);
    printf("x is %s, w is %s\n", mgpu_tensor_describe(x0, text, sizeof text),
           mgpu_tensor_describe(w1, text + 32, 32));

    /* the mistake: y = x * w with x on device 0 and w on device 1. Refused, nothing computed. */
    mgpu_tensor_fill(y1, -7.0);
    if (mgpu_mul(y1, x0, w1) == MGPU_OK) {
        check(0, "an op on two devices ran");
    } else {
        const char* msg = mgpu_last_error();
        printf("mgpu_mul(y, x, w) failed: %s\n  %s\n", mgpu_result_string(mgpu_last_result()), msg);
        check(mgpu_last_result() == MGPU_ERROR_DEVICE_MISMATCH, "the error is not MGPU_ERROR_DEVICE_MISMATCH");
        check(strstr(msg, "mgpu_mul") != NULL, "the message does not name the op");
        check(strstr(msg, mgpu_device_label(d0)) && strstr(msg, mgpu_device_label(d1)), "the message does not name both devices");
        mgpu_tensor_download(y1, got, sizeof got);
        check(got[0] == -7.0f && got[N - 1] == -7.0f, "the refused op wrote its output");
    }

    /* the fix: x.to(d1), then the op runs where w is */
    x1 = mgpu_tensor_to(x0, d1);
    if (!x1) { printf("%s\n", mgpu_last_error()); return 1; }
    check(mgpu_tensor_device(x1) == d1, "mgpu_tensor_to did not put the copy on d1");
    if (mgpu_mul(y1, x1, w1) != MGPU_OK) { printf("%s\n", mgpu_last_error()); return 1; }

    /* y.cpu(): a copy on the CPU, where the program can read it (download waits for the device) */
    ycpu = mgpu_tensor_to(y1, mgpu_device_cpu());
    if (!ycpu) { printf("%s\n", mgpu_last_error()); return 1; }
    mgpu_tensor_download(ycpu, got, sizeof got);
    printf("y = x * w on %s:", mgpu_device_label(d1));
    for (i = 0; i < N; ++i) {
        printf(" %g", got[i]);
        check(got[i] == xs[i] * ws[i], "y differs from x * w computed in plain C");
    }
    printf("\n");

    /* dst.copy_(src) into a tensor that exists: y back onto device 0, over x */
    mgpu_tensor_copy(x0, y1);
    mgpu_tensor_download(x0, got, sizeof got);
    check(memcmp(got, (float[N]){ 0.5f, -2, 6, 0, 15, -12 }, sizeof got) == 0, "copy back to device 0");

    mgpu_tensor_destroy(ycpu);
    mgpu_tensor_destroy(x1);
    mgpu_tensor_destroy(y1);
    mgpu_tensor_destroy(w1);
    mgpu_tensor_destroy(x0);
    mgpu_device_set_destroy(set);
    if (failures) return 1;
    printf("tensors ok\n");
    return 0;
}
