/* tests/emu/ckpt_diff.c - compares two safetensors checkpoints of the same model, tensor by
   tensor: prints the largest relative difference max|a - b| / max|b| (over each tensor's float32
   elements) and exits 1 when it is above TOLERANCE or the files do not match in layout.
   Usage: ckpt_diff A.safetensors B.safetensors TOLERANCE */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static unsigned char* slurp(const char* path, size_t* size) {
    FILE* f = fopen(path, "rb");
    unsigned char* p;
    long n;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    p = (unsigned char*)malloc(n > 0 ? (size_t)n : 1);
    if (p && fread(p, 1, (size_t)n, f) != (size_t)n) { free(p); p = NULL; }
    fclose(f);
    *size = (size_t)n;
    return p;
}

int main(int argc, char** argv) {
    size_t na, nb;
    unsigned char *a, *b;
    uint64_t ha = 0, hb = 0;
    double tol, worst = 0.0;
    const char *h, *end;
    char worst_name[128] = "";
    int i, tensors = 0;
    if (argc != 4) { fprintf(stderr, "usage: ckpt_diff A B TOLERANCE\n"); return 2; }
    tol = atof(argv[3]);
    a = slurp(argv[1], &na);
    b = slurp(argv[2], &nb);
    if (!a || !b || na < 8 || nb < 8) { fprintf(stderr, "ckpt_diff: cannot read %s or %s\n", argv[1], argv[2]); return 2; }
    for (i = 7; i >= 0; --i) { ha = ha << 8 | a[i]; hb = hb << 8 | b[i]; }
    if (ha != hb || na != nb || 8 + ha > na || memcmp(a + 8, b + 8, (size_t)ha) != 0) {
        fprintf(stderr, "ckpt_diff: %s and %s differ in layout\n", argv[1], argv[2]);
        return 1;
    }
    /* each tensor: "name":{"dtype":"F32","shape":[...],"data_offsets":[begin,end]} */
    h = (const char*)a + 8;
    end = h + ha;
    while ((h = strstr(h, "\"dtype\"")) != NULL && h < end) {
        const char* name_end = h;
        const char* name_start;
        const char* off = strstr(h, "\"data_offsets\"");
        unsigned long long begin, stop;
        char name[128];
        int f32 = strncmp(h, "\"dtype\":\"F32\"", 13) == 0;
        while (name_end > (const char*)a + 8 && *name_end != '{') --name_end;   /* back to "name":{ */
        name_start = name_end - 3;
        while (name_start > (const char*)a + 8 && *name_start != '"') --name_start;
        snprintf(name, sizeof name, "%.*s", (int)(name_end - 3 - name_start), name_start + 1);
        if (!off || off > end || sscanf(off, "\"data_offsets\":[%llu,%llu]", &begin, &stop) != 2) break;
        h = off + 14;
        if (!f32) continue;
        {
            const float* x = (const float*)(a + 8 + ha + begin);
            const float* y = (const float*)(b + 8 + ha + begin);
            size_t n = (size_t)(stop - begin) / 4, k;
            double diff = 0.0, scale = 0.0, rel;
            for (k = 0; k < n; ++k) {
                double d = fabs((double)x[k] - (double)y[k]);
                if (x[k] != x[k] || y[k] != y[k]) d = INFINITY;
                if (d > diff) diff = d;
                if (fabs((double)y[k]) > scale) scale = fabs((double)y[k]);
            }
            rel = diff / (scale > 1e-30 ? scale : 1.0);
            if (rel > worst || tensors == 0) { worst = rel; snprintf(worst_name, sizeof worst_name, "%s", name); }
            ++tensors;
        }
    }
    if (tensors == 0) { fprintf(stderr, "ckpt_diff: no float32 tensors in %s\n", argv[1]); return 1; }
    printf("%d tensors, max relative difference %.3g (%s)\n", tensors, worst, worst_name);
    return worst <= tol ? 0 : 1;
}
