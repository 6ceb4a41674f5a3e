/* examples/course/solutions/02_ex2.c - lesson 02, exercise 2: x.to(y.device), in C.

   A helper that returns t itself when it is already on ref's device, else a copy there (which the
   caller destroys): what PyTorch code writes as x.to(w.device). With it, y = x @ w^T runs where w
   is, whichever device x came from; the result is checked against plain C. Without it, the
   matmul is refused: the program shows that too. */
// course-run: cpu:2
// course-run-emu 2: cuda:0,1
// course-expect: are on different devices
// course-expect: to_device_of ok
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>

/* t on ref's device: t itself, or a new copy (*made set to it, for the caller to destroy) */
static const mgpu_tensor* to_device_of(const mgpu_tensor* t, const mgpu_tensor* ref, mgpu_tensor** made) {
    *made = NULL;
    if (mgpu_tensor_device(t) == mgpu_tensor_device(ref)) return t;
    *made = mgpu_tensor_to(t, mgpu_tensor_device(ref));
    return *made;
}

int main(int argc, char** argv) {
    /* x [2,3] on device 0, w [4,3] on device 1, y = x w^T [2,4] on device 1 */
    const float xs[6] = { 1, 2, 3, -1, 0, 2 };
    const float ws[12] = { 1, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1 };
    float got[8];
    mgpu_device_set* set = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu:2");
    mgpu_tensor *x, *w, *y, *xcopy, *wcopy;
    const mgpu_tensor* xw;
    int i, j, k, failures = 0;
    if (!set || mgpu_device_set_count(set) < 2) { printf("want two devices: %s\n", mgpu_last_error()); return 1; }
    x = mgpu_tensor_create(mgpu_device_set_get(set, 0), MGPU_F32, mgpu_shape2(2, 3));
    w = mgpu_tensor_create(mgpu_device_set_get(set, 1), MGPU_F32, mgpu_shape2(4, 3));
    y = mgpu_tensor_create(mgpu_device_set_get(set, 1), MGPU_F32, mgpu_shape2(2, 4));
    if (!x || !w || !y) { printf("%s\n", mgpu_last_error()); return 1; }
    mgpu_tensor_upload(x, xs, sizeof xs);
    mgpu_tensor_upload(w, ws, sizeof ws);

    /* without the helper: refused */
    if (mgpu_matmul(y, x, w, MGPU_NO_TRANS, MGPU_TRANS, 1.0f, 0.0f) == MGPU_OK) { printf("WRONG: a matmul across devices ran\n"); failures++; }
    else printf("without it: %s\n", mgpu_last_error());

    /* with it */
    xw = to_device_of(x, w, &xcopy);   /* x.to(w.device) */
    if (!xw || mgpu_matmul(y, xw, w, MGPU_NO_TRANS, MGPU_TRANS, 1.0f, 0.0f) != MGPU_OK) { printf("%s\n", mgpu_last_error()); return 1; }
    mgpu_tensor_download(y, got, sizeof got);
    for (i = 0; i < 2; ++i)
        for (j = 0; j < 4; ++j) {
            float want = 0.0f;
            for (k = 0; k < 3; ++k) want += xs[i * 3 + k] * ws[j * 3 + k];
            if (got[i * 4 + j] != want) { printf("WRONG: y[%d][%d] = %g, want %g\n", i, j, got[i * 4 + j], want); failures++; }
        }
    printf("with it: y = x w^T on %s = [%g %g %g %g; %g %g %g %g]\n", mgpu_device_label(mgpu_tensor_device(y)),
           got[0], got[1], got[2], got[3], got[4], got[5], got[6], got[7]);
    /* already there: no copy */
    if (to_device_of(w, y, &wcopy) != w || wcopy) { printf("WRONG: a copy of a tensor already in place\n"); failures++; }

    mgpu_tensor_destroy(xcopy);   /* NULL when x was already there: does nothing */
    mgpu_tensor_destroy(y);
    mgpu_tensor_destroy(w);
    mgpu_tensor_destroy(x);
    mgpu_device_set_destroy(set);
    if (failures) return 1;
    printf("to_device_of ok\n");
    return 0;
}
