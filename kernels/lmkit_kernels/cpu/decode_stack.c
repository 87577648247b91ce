/* One decode step of a Llama-family decoder stack in one C call (CPU, float32
 * activations, GGUF-quantized projections with the norm and SiLU folds).
 *
 * The Python-sequenced path runs, per layer and step, about five kernel calls through
 * ctypes plus the decoder layer's glue (views, allocations, checks): about 20% of a
 * SmolLM2-135M decode step at batch 1. This file calls the SAME kernels, in the same
 * order, with the same arguments, through function pointers that Python hands it
 * (qgemv.c's lmkit_qgemv[_norm|_silu]_*, rope.c's lmkit_rope_inplace, paged_decode.c's
 * lmkit_store_kv and lmkit_paged_decode, rms_norm.c's lmkit_add_rms_norm), so the
 * libraries stay separate builds and every result is the Python path's bit for bit.
 *
 * Per layer, for the step's m rows (x: the stream entering the layer, res: the residual):
 *   qkv = rms_norm(x + res) * w_in @ Wqkv.T (+ b)     lmkit_qgemv_norm   (res' = x + res)
 *   rope(q and k heads of qkv, cos, sin)               lmkit_rope_inplace
 *   store k, v at slot_mapping; attn = attention(q)    lmkit_store_kv, lmkit_paged_decode
 *   o = attn @ Wo.T (+ b)                              lmkit_qgemv
 *   gu = rms_norm(o + res') * w_post @ Wgu.T (+ b)     lmkit_qgemv_norm   (res'' = o + res')
 *   x = (silu(gate) * up) @ Wdown.T (+ b)              lmkit_qgemv_silu
 * Layer 0 has no residual: its first norm reads x alone and the residual is x. After the
 * last layer: out = rms_norm(x + res) * w_final (lmkit_add_rms_norm).
 * Taps (a draft head's features): the stream entering each tapped layer (x + res, the
 * residual the first fold writes; layer 0: x) is copied out, as the Python layers give it.
 *
 * Built at run time by lmkit_kernels/cpu/build.py; nothing here starts threads (the
 * kernels it calls use their own pools, as when Python calls them).
 */
#include <stdint.h>
#include <stddef.h>

int lmkit_decode_stack_abi(void) { return 3; }

typedef int (*qgemv_fn)(int type, const float* x, long ldx, const uint8_t* w, const float* b,
                        float* y, long ldy, long m, long n, long k, int threads);
typedef int (*qgemv_norm_fn)(int type, const float* x, long ldx, const float* res, long ldr,
                             const float* nw, float eps, float* res_out, long ldo,
                             const uint8_t* w, const float* b, float* y, long ldy, long m,
                             long n, long k, int threads);
typedef int (*qgemv_silu_fn)(int type, void* exp16, const float* x, long ldx,
                             const uint8_t* w, const float* b, float* y, long ldy, long m,
                             long n, long k, int threads);
typedef void (*rope_fn)(float* x, long ldx, const float* cos, const float* sin, long m,
                        long heads, long dim);
typedef void (*store_kv_fn)(const float* k, long ldk, const float* v, long ldv,
                            const int64_t* slot_mapping, long num_tokens, float* cache,
                            long num_slots, long kv_width);
typedef int (*decode_fn)(const float* q, long ldq, const float* cache, long num_slots,
                         const int32_t* block_tables, long ldbt, const int32_t* seq_lens,
                         float* out, long num_reqs, long num_heads, long num_kv_heads,
                         long head_size, long block_size, float scale, long window,
                         int threads);
typedef void (*norm_fn)(const float* x, long ldx, const float* residual, long ldr,
                        const float* weight, float eps, float* out, float* res_out, long m,
                        long n);

/* A packed quantized projection y [m, n] = x [m, k] @ W.T (+ bias): qgemv.c's arguments. */
typedef struct { int type; const uint8_t* w; const float* bias; long n, k; } ds_linear;

/* qkv.n + qkv_tail.n = (num_heads + 2 kv heads) * head_dim; qkv_tail (n = 0: none) is
 * the fused QKV's last rows when they have another type than the first ones (a Q4_K_M
 * file's Q6_K value projection beside Q4_K query and key): its own call, same input */
typedef struct {
    ds_linear qkv, o, gate_up, down;
    ds_linear qkv_tail;
    const float* input_norm; float input_eps;
    const float* post_norm; float post_eps;
} ds_layer;

/* Built once per model (the weights' addresses, shapes, kernels). */
typedef struct {
    long num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float scale; long window;              /* attention: scale, sliding window (0: none) */
    const float* final_norm; float final_eps;
    qgemv_fn qgemv; qgemv_norm_fn qgemv_norm; qgemv_silu_fn qgemv_silu; void* exp16;
    rope_fn rope; store_kv_fn store_kv; decode_fn decode; norm_fn norm;
    const ds_layer* layers;                /* [num_layers] */
} ds_plan;

/* One step's arguments. */
typedef struct {
    long m;                                /* rows: one decoding token per request */
    const float* x; long ldx;              /* embeddings [m, hidden], rows ldx apart */
    const float* cos; const float* sin;    /* [m, head_dim] each */
    const int64_t* slot_mapping;           /* [m] */
    const int32_t* block_tables; long ldbt;/* [m, max_blocks] */
    const int32_t* seq_lens;               /* [m], context including the new token */
    float* const* kv_caches; long num_slots; /* per layer [2, num_slots, kv heads, dim] */
    float* out;                            /* [m, hidden]: the final norm's output */
    float* work;                           /* lmkit_decode_stack_work_floats(plan, m) */
    int threads;
    long num_taps;                         /* taps: the stream entering layer */
    const long* tap_layers;                /*   tap_layers[t] copied to */
    float* const* tap_out;                 /*   tap_out[t], [m, hidden] contiguous */
} ds_step;

/* Copy rows [m, H] of src (rows ld apart) to each tap of layer i. */
static void copy_taps(const ds_step* s, long i, const float* src, long ld, long H) {
    for (long t = 0; t < s->num_taps; t++) {
        if (s->tap_layers[t] != i) continue;
        float* dst = s->tap_out[t];
        for (long r = 0; r < s->m; r++)
            for (long c = 0; c < H; c++) dst[r * H + c] = src[r * ld + c];
    }
}

/* Floats of scratch a step of m rows needs (ds_step.work). */
long lmkit_decode_stack_work_floats(const ds_plan* p, long m) {
    long qkv = p->layers[0].qkv.n + p->layers[0].qkv_tail.n, q = p->num_heads * p->head_dim;
    return m * (qkv + q + 4 * p->hidden + 2 * p->intermediate);
}

/* Runs the step: 0, or 1 when a kernel could not allocate its scratch. */
int lmkit_decode_stack(const ds_plan* p, const ds_step* s) {
    const long m = s->m, H = p->hidden, hd = p->head_dim;
    const long q_size = p->num_heads * hd, kv_width = p->num_kv_heads * hd;
    const long nqkv = p->layers[0].qkv.n + p->layers[0].qkv_tail.n, I = p->intermediate;
    float* qkv = s->work;                  /* [m, nqkv] */
    float* attn = qkv + m * nqkv;          /* [m, q_size] */
    float* o = attn + m * q_size;          /* [m, H] */
    float* r0 = o + m * H;                 /* [m, H]: the residual between layers */
    float* r1 = r0 + m * H;                /* [m, H]: the residual inside a layer */
    float* gu = r1 + m * H;                /* [m, 2I] */
    float* x = gu + m * 2 * I;             /* [m, H]: the stream entering the next layer */
    const float* in = s->x;                /* layer 0 reads the embeddings */
    long ld_in = s->ldx;
    const float* res = NULL;               /* layer 0: no residual yet (it is `in`) */
    long ld_res = 0;
    const int th = s->threads;
    for (long i = 0; i < p->num_layers; i++) {
        const ds_layer* L = p->layers + i;
        float* cache = s->kv_caches[i];
        /* input norm folded into QKV; the residual becomes in + res (in alone: layer 0) */
        float* res_in = res ? r1 : NULL;
        if (p->qgemv_norm(L->qkv.type, in, ld_in, res, ld_res, L->input_norm, L->input_eps,
                          res_in, H, L->qkv.w, L->qkv.bias, qkv, nqkv, m, L->qkv.n, H, th))
            return 1;
        /* the tail recomputes the same norm (and writes the same residual) */
        if (L->qkv_tail.n
            && p->qgemv_norm(L->qkv_tail.type, in, ld_in, res, ld_res, L->input_norm,
                             L->input_eps, res_in, H, L->qkv_tail.w, L->qkv_tail.bias,
                             qkv + L->qkv.n, nqkv, m, L->qkv_tail.n, H, th))
            return 1;
        const float* res_attn = res ? r1 : in;
        long ld_res_attn = res ? H : ld_in;
        if (s->num_taps) copy_taps(s, i, res_attn, ld_res_attn, H);
        p->rope(qkv, nqkv, s->cos, s->sin, m, p->num_heads + p->num_kv_heads, hd);
        p->store_kv(qkv + q_size, nqkv, qkv + q_size + kv_width, nqkv, s->slot_mapping, m,
                    cache, s->num_slots, kv_width);
        if (p->decode(qkv, nqkv, cache, s->num_slots, s->block_tables, s->ldbt, s->seq_lens,
                      attn, m, p->num_heads, p->num_kv_heads, hd, p->block_size, p->scale,
                      p->window, th))
            return 1;
        if (p->qgemv(L->o.type, attn, q_size, L->o.w, L->o.bias, o, H, m, H, q_size, th))
            return 1;
        /* post-attention norm folded into gate-up; the residual becomes o + res_attn */
        if (p->qgemv_norm(L->gate_up.type, o, H, res_attn, ld_res_attn, L->post_norm,
                          L->post_eps, r0, H, L->gate_up.w, L->gate_up.bias, gu, 2 * I, m,
                          2 * I, H, th))
            return 1;
        if (p->qgemv_silu(L->down.type, p->exp16, gu, 2 * I, L->down.w, L->down.bias, x, H,
                          m, H, I, th))
            return 1;
        in = x, ld_in = H;
        res = r0, ld_res = H;
    }
    /* the final norm (r1 takes the discarded x + res) */
    p->norm(in, ld_in, res, ld_res, p->final_norm, p->final_eps, s->out, r1, m, H);
    return 0;
}
