import sys, math
from collections import OrderedDict
sys.path.insert(0, '/work/wt/policy')
from tiered_kv.replay.trace import read_trace
from tiered_kv.replay.simulate import simulate_policy, unique_blocks

class Pol:
    def __init__(s, kind, n):
        s.kind, s.n = kind, n
        s.T = {1: OrderedDict(), 2: OrderedDict()}
        s.B = {0: OrderedDict(), 1: OrderedDict()}
        s.p = 0.1 * n if kind == 'window' else 0.0
        s.low, s.high = 0.05 * n, 0.2 * n
        s.marks = OrderedDict()  # frequent marks (no adaptation)
    def __len__(s): return len(s.T[1]) + len(s.T[2])
    def __contains__(s, k): return k in s.T[1] or k in s.T[2]
    def insert(s, keys):
        inw = inm = 0
        dest = []
        for k in keys:
            to2 = False
            if k in s.B[0] or k in s.B[1]:
                l = 0 if k in s.B[0] else 1
                if s.kind == 'arc':
                    g1, g2 = len(s.B[0]), len(s.B[1])
                    if l == 0: s.p = min(s.n, s.p + max(1.0, g2 / g1))
                    else: s.p = max(0.0, s.p - max(1.0, g1 / g2))
                elif s.kind == 'window':
                    if l == 0: inw += 1
                    else: inm += 1
                del s.B[l][k]; to2 = True
            if k in s.marks:
                del s.marks[k]; to2 = True
            dest.append(to2)
        if s.kind == 'window':
            s.p = min(s.high, max(s.low, s.p + inw - inm))
        for k, d in zip(keys, dest):
            if s.kind == 'lru': s.T[1][k] = None
            else: s.T[2 if d else 1][k] = None
    def touch(s, keys):
        for k in keys:
            if s.kind == 'lru':
                if k in s.T[1]: s.T[1].move_to_end(k)
                continue
            if k in s.T[1]: del s.T[1][k]; s.T[2][k] = None
            elif k in s.T[2]: s.T[2].move_to_end(k)
    def remove(s, k):
        s.T[1].pop(k, None); s.T[2].pop(k, None)
    def mark(s, k, cap):
        s.marks[k] = None; s.marks.move_to_end(k)
        while len(s.marks) > cap: s.marks.popitem(last=False)
    def add_ghost(s, k, l):
        s.B[0].pop(k, None); s.B[1].pop(k, None)
        if s.kind == 'arc':
            b0, b1 = len(s.B[0]), len(s.B[1])
            if b0 + b1 >= s.n:
                d = b0 - b1
                pl = (0 if d >= 0 else 1) if l == 0 else (1 if d <= 0 else 0)
                s.B[pl].popitem(last=False)
        else:
            bound = (4 if l == 0 else 2) * s.n
            if len(s.B[l]) >= bound: s.B[l].popitem(last=False)
        s.B[l][k] = None
    def demote(s, k, remember):
        if k in s:
            s.remove(k)
            if remember and s.kind == 'window': s.add_ghost(k, 1)
    def evict(s, n, pinned):
        cands = lambda l, w: [k for k in s.T[l] if k not in pinned][:w]
        if s.kind == 'lru':
            out = cands(1, n); fr = [1]*len(out)
        else:
            over = math.ceil(len(s.T[1]) - s.p)
            first = min(n, max(0, over))
            c1 = cands(1, first); a = len(c1)
            c2 = cands(2, n - a); j2 = len(c2)
            if a + j2 < n:
                c1 = cands(1, n - j2)
            out = c1[:a] + c2 + c1[a:n - j2]; fr = [1]*a + [2]*j2 + [1]*(n-j2-a)
        if len(out) != n: return []
        for k, f in zip(out, fr):
            s.remove(k)
            if s.kind != 'lru': s.add_ghost(k, 0 if f == 1 else 1)
        return out

def run(reqs, G, B, kind, remember_loaded, mark_gpu, bt=512):
    gpu = OrderedDict()  # key -> None, LRU oldest first
    pol = Pol(kind, B)
    cold = OrderedDict()  # cached copies of blocks loaded into gpu
    hits = refs = 0
    for r in reqs:
        ids = list(r.hash_ids); refs += len(ids)
        if r.input_length % bt and ids: ids = ids[:-1]
        ids = ids[:G]
        if not ids: continue
        ng = 0
        for k in ids:
            if k in gpu: ng += 1
            else: break
        # gpu allocation: evict LRU (not the request's own hits)
        need = len(ids) - ng
        own = set(ids[:ng])
        evicted = []
        avail = G - len(gpu)
        for k in list(gpu):
            if need <= avail: break
            if k in own: continue
            del gpu[k]; evicted.append(k); avail += 1
        if mark_gpu:
            for k in ids[:ng]: pol.mark(k, mark_gpu)
        # touch rest (last first)
        rest = ids[ng:]
        for k in reversed(rest):
            if k in cold: pass
        pol.touch([k for k in reversed(rest) if k in pol])
        # lookup/load
        n = 0
        for k in rest:
            if k in pol or k in cold: n += 1
            else: break
        hits += ng + n
        for k in reversed(rest[:n]):
            if k in pol:
                pol.demote(k, False); cold[k] = None
                if remember_loaded: pol.mark(k, 10**9)
            # already cold: stays
        # store evicted, newest first as one batch; first key most recent -> touch/insert last-first
        batch = list(reversed(evicted))
        new = [k for k in batch if k not in pol and k not in cold]
        res = [k for k in batch if k in pol or k in cold]
        short = len(new) - (B - len(pol) - len(cold))
        if short > 0:
            # cold first
            while short > 0 and cold:
                cold.popitem(last=False); short -= 1
            if short > 0:
                pol.evict(min(short, len(pol) - 0), set())
        # insert new in reverse order (last first), resident cold -> back to policy
        for k in reversed(batch):
            if k in cold:
                del cold[k]; pol.insert([k])
            elif k in pol: pol.touch([k])
            elif len(pol) + len(cold) < B:
                pol.insert([k])
        # gpu finish: publish last block first
        for k in reversed(ids):
            gpu[k] = None; gpu.move_to_end(k)
    return hits / refs

if __name__ == '__main__':
    reqs = read_trace('/work/shared/data/mooncake_synthetic_trace.jsonl') if False else None
    from tiered_kv.replay.sizing import split_capacity, longest_request
    reqs = read_trace('/work/shared/data/mooncake_synthetic_trace.jsonl')
    u = unique_blocks(reqs)
    for share in [float(x) for x in sys.argv[1].split(',')]:
        sp = split_capacity(u, longest_request(reqs), share)
        G, B = sp.gpu, sp.cpu + sp.disk
        for kind in sys.argv[2].split(','):
            flat = simulate_policy(reqs, G + B, kind, drop_partial=True).hit_rate
            out = [f"{share} {kind} flat={flat*100:.2f}"]
            for rl, mg in [(False, 0), (True, 0), (True, G), (True, G + B)]:
                out.append(f"rl={int(rl)},mg={mg}: {run(reqs, G, B, kind, rl, mg)*100:.2f}")
            print(" | ".join(out), flush=True)
