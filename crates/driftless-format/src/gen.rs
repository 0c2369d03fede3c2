//! A generator of RL-like weight chains for tests, benchmarks and the demo.
//!
//! Model of a step (the same as the reference generator the README cites): FP32 master
//! weights `w`; gradient `g = signal * d + noise` with `d` a fixed per-weight direction and
//! noise ~ N(0, 1); Adam (beta1 0.9, beta2 0.999, eps 1e-8, bias correction); the published
//! view is BF16, round-to-nearest-even of `w`. At RL learning rates most updates are below half
//! a BF16 spacing and vanish in the cast, which is what makes deltas sparse.
//!
//! Randomness is counter-based (a hash of seed, tensor, element and step), so steps are
//! reproducible, need no stored direction and are generated in parallel.

use rayon::prelude::*;

use crate::{DType, Result, TensorMeta, TensorView};

/// How a synthetic tensor is initialised.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Normal with this standard deviation (linear layers, embeddings).
    Normal(f32),
    /// Near 1.0 (norm weights): 1 + N(0, 0.02).
    Ones,
}

/// Tensors of a synthetic model.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    /// (name, shape, init).
    pub tensors: Vec<(String, Vec<u64>, Init)>,
}

impl ModelSpec {
    /// A Llama-shaped model: embeddings, per layer attention (q, k, v, o), MLP (gate, up, down)
    /// and two norms, a final norm and an LM head.
    pub fn llama_like(vocab: u64, hidden: u64, inter: u64, layers: u64) -> Self {
        let mut t = vec![("model.embed_tokens.weight".to_string(), vec![vocab, hidden], Init::Normal(0.02))];
        for l in 0..layers {
            let p = format!("model.layers.{l}");
            for n in ["q_proj", "k_proj", "v_proj", "o_proj"] {
                t.push((format!("{p}.self_attn.{n}.weight"), vec![hidden, hidden], Init::Normal(0.02)));
            }
            t.push((format!("{p}.mlp.gate_proj.weight"), vec![inter, hidden], Init::Normal(0.02)));
            t.push((format!("{p}.mlp.up_proj.weight"), vec![inter, hidden], Init::Normal(0.02)));
            t.push((format!("{p}.mlp.down_proj.weight"), vec![hidden, inter], Init::Normal(0.02)));
            t.push((format!("{p}.input_layernorm.weight"), vec![hidden], Init::Ones));
            t.push((format!("{p}.post_attention_layernorm.weight"), vec![hidden], Init::Ones));
        }
        t.push(("model.norm.weight".to_string(), vec![hidden], Init::Ones));
        t.push(("lm_head.weight".to_string(), vec![vocab, hidden], Init::Normal(0.02)));
        ModelSpec { tensors: t }
    }

    /// A Llama-shaped model of roughly `bytes` bytes of BF16 weights (at least a few KiB).
    pub fn with_bf16_bytes(bytes: u64) -> Self {
        // hidden h, inter 2.75h, vocab 8h, layers L: params ~ 16h^2 + L * (4h^2 + 8.25h^2).
        let params = bytes / 2;
        let layers = if params > 50_000_000 { 8 } else { 2 };
        let h2 = params as f64 / (16.0 + layers as f64 * 12.25);
        let hidden = ((h2.sqrt() as u64) / 16 * 16).max(16);
        ModelSpec::llama_like(hidden * 8, hidden, hidden * 11 / 4, layers)
    }

    /// Metadata of the BF16 view.
    pub fn metas(&self) -> Vec<TensorMeta> {
        self.tensors
            .iter()
            .map(|(n, s, _)| TensorMeta { name: n.clone(), dtype: DType::BF16, shape: s.clone() })
            .collect()
    }
}

#[inline(always)]
fn mix(mut z: u64) -> u64 {
    // splitmix64 finalizer.
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    z ^ (z >> 31)
}

/// Approximately standard normal from 64 random bits (Irwin-Hall of 4 uniforms, rescaled):
/// cheap, symmetric, unit variance; the tails do not matter here.
#[inline(always)]
fn normal(bits: u64) -> f32 {
    let s = (bits & 0xffff) + ((bits >> 16) & 0xffff) + ((bits >> 32) & 0xffff) + (bits >> 48);
    ((s as f32) / 65536.0 - 2.0) * 1.732_050_8
}

/// Round-to-nearest-even FP32 -> BF16 bit pattern (NaN stays NaN).
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// A running RL chain: Adam state and the BF16 view of every tensor.
#[derive(Debug)]
pub struct RlChain {
    metas: Vec<TensorMeta>,
    master: Vec<Vec<f32>>,
    m: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    view: Vec<Vec<u8>>,
    step: u64,
    /// Learning rate.
    pub lr: f32,
    /// Weight of the persistent gradient direction.
    pub signal: f32,
    seed: u64,
}

const PAR: usize = 1 << 16;

impl RlChain {
    /// A chain from a synthetic spec.
    pub fn new(spec: &ModelSpec, lr: f32, seed: u64) -> Self {
        let master: Vec<Vec<f32>> = spec
            .tensors
            .iter()
            .enumerate()
            .map(|(ti, (_, shape, init))| {
                let n: u64 = shape.iter().product();
                let mut w = vec![0f32; n as usize];
                w.par_chunks_mut(PAR).enumerate().for_each(|(c, ch)| {
                    for (i, x) in ch.iter_mut().enumerate() {
                        let r = normal(mix(seed ^ 0x5eed ^ ((ti as u64) << 40) ^ (c * PAR + i) as u64));
                        *x = match init {
                            Init::Normal(s) => r * s,
                            Init::Ones => 1.0 + 0.02 * r,
                        };
                    }
                });
                w
            })
            .collect();
        Self::from_master(spec.metas(), master, lr, seed)
    }

    /// A chain starting from given FP32 weights (for example a real model's).
    pub fn from_master(metas: Vec<TensorMeta>, master: Vec<Vec<f32>>, lr: f32, seed: u64) -> Self {
        let metas: Vec<TensorMeta> = metas.into_iter().map(|m| TensorMeta { dtype: DType::BF16, ..m }).collect();
        let m = master.iter().map(|w| vec![0f32; w.len()]).collect();
        let v = master.iter().map(|w| vec![0f32; w.len()]).collect();
        let view = master.iter().map(|w| vec![0u8; w.len() * 2]).collect();
        let mut c = RlChain { metas, master, m, v, view, step: 0, lr, signal: 0.3, seed };
        c.refresh_view();
        c
    }

    /// Reads FP32/BF16/F16 weights of a checkpoint as the starting master weights.
    pub fn from_checkpoint(views: &[TensorView<'_>], lr: f32, seed: u64) -> Result<Self> {
        let mut metas = vec![];
        let mut master = vec![];
        for t in views {
            let w: Vec<f32> = match t.dtype {
                DType::F32 => t.data.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect(),
                DType::BF16 => t
                    .data
                    .chunks_exact(2)
                    .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
                    .collect(),
                _ => continue,
            };
            metas.push(t.meta());
            master.push(w);
        }
        Ok(Self::from_master(metas, master, lr, seed))
    }

    fn refresh_view(&mut self) {
        self.master.par_iter().zip(self.view.par_iter_mut()).for_each(|(w, v)| {
            for (x, o) in w.iter().zip(v.chunks_exact_mut(2)) {
                o.copy_from_slice(&f32_to_bf16(*x).to_le_bytes());
            }
        });
    }

    /// One Adam step on every tensor; updates the BF16 view.
    pub fn step(&mut self) {
        self.step += 1;
        let t = self.step as i32;
        let (lr, signal, seed, step) = (self.lr, self.signal, self.seed, self.step);
        let bc1 = 1.0 - 0.9f32.powi(t);
        let bc2 = 1.0 - 0.999f32.powi(t);
        for (ti, ((w, m), (v, view))) in
            self.master.iter_mut().zip(self.m.iter_mut()).zip(self.v.iter_mut().zip(self.view.iter_mut())).enumerate()
        {
            w.par_chunks_mut(PAR)
                .zip(m.par_chunks_mut(PAR))
                .zip(v.par_chunks_mut(PAR).zip(view.par_chunks_mut(PAR * 2)))
                .enumerate()
                .for_each(|(c, ((w, m), (v, out)))| {
                    for i in 0..w.len() {
                        let idx = ((ti as u64) << 40) ^ (c * PAR + i) as u64;
                        let d = normal(mix(seed ^ 0xd1 ^ idx));
                        let noise = normal(mix(seed ^ idx ^ step.wrapping_mul(0x9e3779b97f4a7c15)));
                        let g = signal * d + noise;
                        m[i] = 0.9 * m[i] + 0.1 * g;
                        v[i] = 0.999 * v[i] + 0.001 * g * g;
                        w[i] -= lr * (m[i] / bc1) / ((v[i] / bc2).sqrt() + 1e-8);
                        out[2 * i..2 * i + 2].copy_from_slice(&f32_to_bf16(w[i]).to_le_bytes());
                    }
                });
        }
    }

    /// Steps taken so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Metadata of the BF16 view.
    pub fn metas(&self) -> &[TensorMeta] {
        &self.metas
    }

    /// Borrowed views of the current BF16 weights.
    pub fn views(&self) -> Vec<TensorView<'_>> {
        self.metas
            .iter()
            .zip(&self.view)
            .map(|(m, d)| TensorView { name: &m.name, dtype: DType::BF16, shape: &m.shape, data: d })
            .collect()
    }

    /// Total bytes of the BF16 view.
    pub fn bytes(&self) -> u64 {
        self.view.iter().map(|v| v.len() as u64).sum()
    }
}

/// Counts changed elements between two views and how many of those are +-1 ulp (BF16/F16).
pub fn change_stats(a: &[TensorView<'_>], b: &[TensorView<'_>]) -> (u64, u64, u64) {
    let (mut total, mut changed, mut one) = (0u64, 0u64, 0u64);
    for (x, y) in a.iter().zip(b) {
        if x.dtype.size() != 2 || x.data.len() != y.data.len() {
            continue;
        }
        for (p, q) in x.data.chunks_exact(2).zip(y.data.chunks_exact(2)) {
            total += 1;
            let p = u16::from_le_bytes([p[0], p[1]]);
            let q = u16::from_le_bytes([q[0], q[1]]);
            if p != q {
                changed += 1;
                if p.abs_diff(q) == 1 {
                    one += 1;
                }
            }
        }
    }
    (total, changed, one)
}
