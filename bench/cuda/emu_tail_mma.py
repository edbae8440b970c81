"""Emulates the fragment mapping of the mma.sync decode tails (CASCADE_CUDA_XV 31-33,
src/cuda/cuda_attn_wgmma.cu, XF bit 33554432) with numpy: the swizzled K/V stage,
ldmatrix (.trans), mma.sync m16n8k16 as the PTX ISA lays out their fragments, and
the kernel's index formulas, checked against Q K^T and P V for each of the four
warps. Prints "mapping ok" or exits 1. A development check of the formulas (the
kernel itself is tested by test-cuda on the GPU). Then the per-warp online
softmax over each warp's 32 keys of every tile and the four warps' merge, as the
kernel computes them, against the direct softmax (ragged tails, 1-16 rows):
prints "merge ok" or exits 1."""
import numpy as np
rng=np.random.default_rng(1)
D=128; KEYS=128
K=rng.standard_normal((KEYS,D)); V=rng.standard_normal((KEYS,D)); Q=rng.standard_normal((16,D))
def swz(key,d):  # element index in the stage (in 2-byte units)
    c=d//8
    byte=(c>>3)*(KEYS*128)+key*128+(((c&7)^(key&7))<<4)+(d%8)*2
    return byte
# smem as dict byte->value(element at that 2-byte offset)
def store(M):
    sm={}
    for k in range(KEYS):
        for d in range(D): sm[swz(k,d)]=M[k,d]
    return sm
sK=store(K); sV=store(V)
def ldsm(sm,addrs,trans):
    # addrs[lane] = row address of matrix lane//8 row lane%8; returns r[lane][j] = (lo,hi)
    rows=[[sm[addrs[8*j+i]+2*e] for e in range(8)] for j in range(4) for i in range(8)]
    out=[[None]*4 for _ in range(32)]
    for t in range(32):
        for j in range(4):
            mat=[rows[8*j+i] for i in range(8)]
            if not trans: out[t][j]=(mat[t//4][2*(t%4)],mat[t//4][2*(t%4)+1])
            else: out[t][j]=(mat[2*(t%4)][t//4],mat[2*(t%4)+1][t//4])
    return out
def mma(c,a,b0,b1):
    # c[lane]=[4], a[lane]=[4 pairs], b0/b1[lane]=pair; m16n8k16
    A=np.zeros((16,16)); B=np.zeros((16,8))
    for t in range(32):
        g,q=t//4,t%4
        A[g,2*q:2*q+2]=a[t][0]; A[g+8,2*q:2*q+2]=a[t][1]; A[g,2*q+8:2*q+10]=a[t][2]; A[g+8,2*q+8:2*q+10]=a[t][3]
        B[2*q:2*q+2,g]=b0[t]; B[2*q+8:2*q+10,g]=b1[t]
    Cm=A@B
    for t in range(32):
        g,q=t//4,t%4
        c[t][0]+=Cm[g,2*q]; c[t][1]+=Cm[g,2*q+1]; c[t][2]+=Cm[g+8,2*q]; c[t][3]+=Cm[g+8,2*q+1]
def box_addr(key,c):
    # the kernel's ldmatrix row address: key's 16-byte chunk c in the swizzled stage
    return (c>>3)*(KEYS*128)+key*128+(((c&7)^(key&7))<<4)
def mma_two(acc,o,a,b):
    # two m16n8k16 into acc[lane][o:o+4] and [o+4:o+8] with B from matrices 0, 1 and 2, 3
    for h in range(2):
        c=[[acc[t][o+4*h+e] for e in range(4)] for t in range(32)]
        mma(c,a,[b[t][2*h] for t in range(32)],[b[t][2*h+1] for t in range(32)])
        for t in range(32):
            for e in range(4): acc[t][o+4*h+e]=c[t][e]
ok=True
for w in range(4):
    # Q fragments
    qf=[[None]*4 for _ in range(32)]
    qfk=[[ [None]*4 for _ in range(32)] for ks in range(D//16)]
    for ks in range(D//16):
        for t in range(32):
            r0=t>>2; r1=r0+8; c=(t&3)*2
            qfk[ks][t]=[(Q[r0,ks*16+c],Q[r0,ks*16+c+1]),(Q[r1,ks*16+c],Q[r1,ks*16+c+1]),(Q[r0,ks*16+c+8],Q[r0,ks*16+c+9]),(Q[r1,ks*16+c+8],Q[r1,ks*16+c+9])]
    sc=[[0.0]*16 for _ in range(32)]
    for ks in range(D//16):
        for np_ in range(2):
            # matrices: key groups 2 np, 2 np + 1 x chunks 2 ks, 2 ks + 1
            b=ldsm(sK,[box_addr(32*w+16*np_+8*((l>>3)>>1)+(l&7),2*ks+((l>>3)&1)) for l in range(32)],False)
            mma_two(sc,8*np_,qfk[ks],b)
    S=Q@K.T
    for t in range(32):
        for k in range(16):
            row=(t>>2)+8*((k>>1)&1); key=32*w+(k>>2)*8+(t&3)*2+(k&1)
            if abs(sc[t][k]-S[row,key])>1e-9: ok=False
    # P = some values: use P[row][key] = sc (the S itself) as probabilities
    P=np.zeros((16,KEYS)); 
    for t in range(32):
        for k in range(16):
            row=(t>>2)+8*((k>>1)&1); key=32*w+(k>>2)*8+(t&3)*2+(k&1); P[row,key]=sc[t][k]
    pa=[[None]*32 for kk in range(2)]
    for kk in range(2):
        for t in range(32):
            s=sc[t]
            pa[kk][t]=[(s[8*kk],s[8*kk+1]),(s[8*kk+2],s[8*kk+3]),(s[8*kk+4],s[8*kk+5]),(s[8*kk+6],s[8*kk+7])]
    oa=[[0.0]*(D//2) for _ in range(32)]
    for kk in range(2):
        for dp in range(D//16):
            # matrices (transposed): keys + 0-7, + 8-15 x chunks 2 dp, 2 dp + 1
            b=ldsm(sV,[box_addr(32*w+16*kk+8*((l>>3)&1)+(l&7),2*dp+((l>>3)>>1)) for l in range(32)],True)
            mma_two(oa,8*dp,pa[kk],b)
    O=P@V
    for t in range(32):
        for dt in range(D//8):
            for e in range(4):
                row=(t>>2)+8*(e>>1); d=dt*8+(t&3)*2+(e&1)
                if abs(oa[t][4*dt+e]-O[row,d])>1e-9: ok=False; 
print("mapping ok" if ok else "MISMATCH")
if not ok:
    raise SystemExit(1)

# --- the online softmax of each warp and the four warps' merge, as the kernel
# does them (per warp: its 32 keys of every tile; sl = scale x log2 e; a row's
# running max m in raw scores, the exponent offset mu = m x sl), against the
# direct softmax over all keys; ragged last tile masked (keys >= kv1)
def tail_task(Q, Kall, Vall, nrows, kv1, scale):
    LOG2E = 1.4426950408889634
    sl = scale * LOG2E
    ntiles = (kv1 + 127) // 128
    st = []
    for w in range(4):
        m = np.full(16, -np.inf); l = np.zeros(16); O = np.zeros((16, Vall.shape[1]))
        for i in range(ntiles):
            keys = np.arange(128 * i + 32 * w, 128 * i + 32 * w + 32)
            s = Q @ Kall[np.minimum(keys, len(Kall) - 1)].T
            s[:, keys >= kv1] = -np.inf
            mx = s.max(axis=1)
            mn = np.maximum(m, mx)
            mu = np.where(mn == -np.inf, 0.0, mn * sl)
            al = np.where(mn == m, 1.0, np.exp2(m * sl - mu))
            p = np.exp2(s * sl - mu[:, None])
            l = l * al + p.sum(axis=1)
            O = O * al[:, None] + p @ (Vall[np.minimum(keys, len(Vall) - 1)] * (keys < kv1)[:, None])
            m = mn
        st.append((m, l, O))
    M = np.max([x[0] for x in st], axis=0)
    L = sum(np.where(x[0] == -np.inf, 0.0, x[1] * np.exp2((x[0] - M) * sl)) for x in st)
    out = np.zeros_like(st[0][2])
    for (m, l, O) in st:
        f = np.where((m == -np.inf) | ~(L > 0), 0.0, np.exp2((m - M) * sl) / np.where(L > 0, L, 1))
        out += O * f[:, None]
    lse = np.where(L > 0, (M * sl + np.log2(np.where(L > 0, L, 1))) * np.log(2), -np.inf)
    return out[:nrows], lse[:nrows]

ok2 = True
for trial in range(20):
    nrows = int(rng.integers(1, 17)); kv1 = int(rng.integers(1, 700)); scale = 1 / np.sqrt(D)
    Qt = rng.standard_normal((16, D)); Qt[nrows:] = 0
    Kt = rng.standard_normal((kv1, D)); Vt = rng.standard_normal((kv1, D))
    o, lse = tail_task(Qt, Kt, Vt, nrows, kv1, scale)
    S = (Qt[:nrows] @ Kt.T) * scale
    P = np.exp(S - S.max(axis=1, keepdims=True))
    ref = (P @ Vt) / P.sum(axis=1, keepdims=True)
    lref = np.log(P.sum(axis=1)) + S.max(axis=1)
    if not (np.allclose(o, ref, atol=1e-10) and np.allclose(lse, lref, atol=1e-10)):
        ok2 = False
print("merge ok" if ok2 else "MERGE MISMATCH")
raise SystemExit(0 if ok2 else 1)
