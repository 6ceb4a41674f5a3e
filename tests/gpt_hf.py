"""tests/gpt_hf.py - build/gpt against Hugging Face transformers' GPT2LMHeadModel (tests/gpt_hf.sh).

A random GPT-2 (2 blocks, 4 heads, width 32, vocabulary 96, 32 positions, no dropout) saved by
save_pretrained(safe_serialization=True) and token files in llm.c's format; then:
  1. build/gpt --eval-only on HF's file: the validation loss (every window of T + 1 tokens, each
     target weighing the same, in batches of B with the last one smaller) within 1e-4 of HF's;
     the hub's layout (no 'transformer.' prefix) gives the same;
  2. six plain SGD steps (--no-shuffle: batch k holds windows kB .. kB+B-1) on cpu, cpu:2 and, when
     built, two emulated GPUs, eager and with --graph: every tensor of the saved model within 1e-4
     (relative to the tensor's largest value) of HF's six steps of torch.optim.SGD on the same
     batches; --graph's file the eager one's bit for bit, its later steps replayed from the graph;
  3. the file build/gpt saved loads into GPT2LMHeadModel and gives the loss build/gpt reports;
  4. controls that must break: HF's steps with another learning rate, and a file with one
     weight changed, differ by more than the bounds.
Prints "N passed, N failed, N skipped" last; usage: gpt_hf.py BUILD_DIR."""
import os
import struct
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

build = sys.argv[1] if len(sys.argv) > 1 else "build"
passed = failed = skipped = 0


def check(ok, what):
    global passed, failed
    if ok:
        passed += 1
        print("  ok   " + what)
    else:
        failed += 1
        print("  FAIL " + what)


V, P, C, L, H, T, B, STEPS, LR = 96, 32, 32, 2, 4, 16, 4, 6, 0.1


def write_tokens(path, tokens):
    header = [20240520, 1, len(tokens)] + [0] * 253
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack("<%dH" % len(tokens), *tokens))


def windows(tokens):
    n = (len(tokens) - 1) // T
    x = torch.tensor([tokens[j * T:j * T + T] for j in range(n)], dtype=torch.long)
    y = torch.tensor([tokens[j * T + 1:j * T + T + 1] for j in range(n)], dtype=torch.long)
    return x, y


def hf_loss(model, x, y):
    """the mean over every target, in batches of B (as build/gpt --eval-only reads them)"""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), B):
            logits = model(x[i:i + B]).logits.double()
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, V), y[i:i + B].reshape(-1), reduction="sum").item()
            count += y[i:i + B].numel()
    return total / count


def run(args, env=None):
    e = dict(os.environ)
    if env:
        e.update(env)
    r = subprocess.run(args, capture_output=True, text=True, env=e)
    if r.returncode != 0:
        print("  command failed (%d): %s\n%s%s" % (r.returncode, " ".join(args), r.stdout[-2000:], r.stderr[-2000:]))
    return r


def last_value(out, key):
    for line in reversed(out.splitlines()):
        for part in line.split():
            if part.startswith(key + "="):
                return float(part[len(key) + 1:])
    return None


def state_of_file(path):
    """mgpu's file (transformer.*) as HF's state_dict names, lm_head tied"""
    return {k: v for k, v in load_file(path).items()}


def max_rel(a, b):
    worst = 0.0
    for k, v in a.items():
        if k not in b:
            return float("inf")
        scale = max(v.abs().max().item(), 1e-30)
        worst = max(worst, (v.double() - b[k].double()).abs().max().item() / scale)
    return worst


def main():
    torch.manual_seed(1)
    cfg = GPT2Config(vocab_size=V, n_positions=P, n_embd=C, n_layer=L, n_head=H, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, layer_norm_epsilon=1e-5)
    ref = GPT2LMHeadModel(cfg).eval()
    gpt = os.path.join(build, "gpt")
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = os.path.join(tmp, "hf")
        ref.save_pretrained(hf_dir, safe_serialization=True)
        hf_file = os.path.join(hf_dir, "model.safetensors")
        g = torch.Generator().manual_seed(2)
        train_tokens = torch.randint(0, V, (B * STEPS * T + 1,), generator=g).tolist()   # W = B x STEPS windows
        val_tokens = torch.randint(0, V, (7 * T + 5,), generator=g).tolist()            # 7 windows: a last batch of 3
        train_bin, val_bin = os.path.join(tmp, "train.bin"), os.path.join(tmp, "val.bin")
        write_tokens(train_bin, train_tokens)
        write_tokens(val_bin, val_tokens)
        vx, vy = windows(val_tokens)
        want = hf_loss(ref, vx, vy)

        # 1. the evaluation loss of HF's file, in its two layouts
        r = run([gpt, "--load", hf_file, "--heads", str(H), "--val", val_bin, "--seq", str(T), "--batch", str(B),
                 "--eval-only", "--devices", "cpu"])
        got = last_value(r.stdout, "val_loss")
        check(got is not None and abs(got - want) <= 1e-4, "eval of HF's file: val_loss %s, HF %.6f" % (got, want))
        hub = os.path.join(tmp, "hub.safetensors")
        save_file({k[len("transformer."):]: v for k, v in load_file(hf_file).items() if k.startswith("transformer.")}, hub,
                  metadata={"format": "pt"})
        r = run([gpt, "--load", hub, "--heads", str(H), "--val", val_bin, "--seq", str(T), "--batch", str(B), "--eval-only",
                 "--devices", "cpu"])
        got_hub = last_value(r.stdout, "val_loss")
        check(got_hub is not None and abs(got_hub - want) <= 1e-4, "eval of the hub's layout: %s, HF %.6f" % (got_hub, want))

        # 2. six SGD steps on HF, batch k = windows kB .. kB+B-1
        model = GPT2LMHeadModel.from_pretrained(hf_dir).train()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        tx, ty = windows(train_tokens)
        for k in range(STEPS):
            opt.zero_grad()
            logits = model(tx[k * B:(k + 1) * B]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), ty[k * B:(k + 1) * B].reshape(-1))
            loss.backward()
            opt.step()
        hf_after = {k: v.detach().clone() for k, v in model.state_dict().items()
                    if not k.endswith(".attn.bias") and not k.endswith(".attn.masked_bias") and k != "lm_head.weight"}
        model.eval()

        layouts = [("cpu", None, []), ("cpu:2", None, [])]
        emu = os.path.join(build, "emu", "gpt")
        if os.path.exists(emu):   # and each step as a CUDA graph's launch: the same bits as eager
            layouts.append(("cuda:0,1", {"MGPU_EMU_DEVICES": "2"}, []))
            layouts.append(("cuda:0,1", {"MGPU_EMU_DEVICES": "2"}, ["--graph"]))
        else:
            global skipped
            skipped += 1
            print("  skip two emulated GPUs: %s is not built (make %s)" % (emu, emu))
        saved = eager = None
        for spec, env, extra in layouts:
            out = os.path.join(tmp, "after_%s%s.safetensors" % (spec.replace(":", "_").replace(",", "_"), "_graph" if extra else ""))
            prog = emu if env else gpt
            r = run([prog, "--load", hf_file, "--heads", str(H), "--data", train_bin, "--val", val_bin, "--seq", str(T),
                     "--batch", str(B), "--steps", str(STEPS), "--optimizer", "sgd", "--lr", str(LR), "--no-shuffle",
                     "--devices", spec, "--save", out, "--sample", "0"] + extra, env)
            spec = " ".join([spec] + extra)
            if r.returncode != 0 or not os.path.exists(out):
                check(False, "six steps on %s ran" % spec)
                continue
            mine = state_of_file(out)
            keys_ok = set(mine) == set(hf_after)
            check(keys_ok, "%s: the saved names are HF's (extra %s, missing %s)" % (
                spec, sorted(set(mine) - set(hf_after))[:3], sorted(set(hf_after) - set(mine))[:3]))
            err = max_rel(hf_after, mine) if keys_ok else float("inf")
            check(err <= 1e-4, "%s: six SGD steps against HF's: largest difference %.3g of a tensor's largest value" % (spec, err))
            if spec == "cpu":
                saved, saved_loss = out, last_value(r.stdout, "val_loss")
            if spec == "cuda:0,1":
                eager = out
            if extra and eager:
                with open(out, "rb") as f1, open(eager, "rb") as f2:
                    same = f1.read() == f2.read()
                graphed = last_value(r.stdout, "graph_steps")
                check(same and graphed is not None and graphed >= STEPS - 2,
                      "%s: the same file as eager, bit for bit, %s of %d steps replayed from the graph" % (spec, graphed, STEPS))

        # 3. the saved file in HF, with the loss build/gpt reported
        if saved:
            d2 = os.path.join(tmp, "hf2")
            os.makedirs(d2)
            cfg.save_pretrained(d2)
            save_file(load_file(saved), os.path.join(d2, "model.safetensors"), metadata={"format": "pt"})
            back = GPT2LMHeadModel.from_pretrained(d2).eval()
            hf_back = hf_loss(back, vx, vy)
            check(saved_loss is not None and abs(hf_back - saved_loss) <= 1e-4,
                  "mgpu's file in HF: loss %.6f, build/gpt reported %s" % (hf_back, saved_loss))

            # 4. controls: another learning rate, and one weight changed, must show
            model = GPT2LMHeadModel.from_pretrained(hf_dir).train()
            opt = torch.optim.SGD(model.parameters(), lr=LR * 1.01)
            for k in range(STEPS):
                opt.zero_grad()
                logits = model(tx[k * B:(k + 1) * B]).logits
                torch.nn.functional.cross_entropy(logits.reshape(-1, V), ty[k * B:(k + 1) * B].reshape(-1)).backward()
                opt.step()
            other = {k: v.detach() for k, v in model.state_dict().items() if k in hf_after}
            check(max_rel(other, state_of_file(saved)) > 1e-4, "control: HF with lr x 1.01 differs from build/gpt's steps")
            bad = state_of_file(saved)
            bad["transformer.h.1.mlp.c_fc.weight"][3, 5] += 0.01
            check(max_rel(hf_after, bad) > 1e-4, "control: one weight changed by 0.01 is seen")

    print("%d passed, %d failed, %d skipped" % (passed, failed, skipped))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
