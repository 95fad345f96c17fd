use super::*;
use candle_core::{Device, Tensor};

const SHAPE: Heads = Heads {
    heads: 6,
    kv_heads: 2,
    head_dim: 20,
    window: None,
};
const WIDTH: usize = (SHAPE.heads + 2 * SHAPE.kv_heads) * SHAPE.head_dim;

fn random(shape: (usize, usize)) -> Tensor {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()
}

fn rotary(positions: usize) -> (Tensor, Tensor, Rotary) {
    rotary_styled(positions, RopeStyle::Interleaved)
}

fn rotary_styled(positions: usize, style: RopeStyle) -> (Tensor, Tensor, Rotary) {
    let cos = random((positions, SHAPE.head_dim / 2));
    let sin = random((positions, SHAPE.head_dim / 2));
    let tables = Rotary::new(&cos, &sin, style).unwrap();
    (cos, sin, tables)
}

/// `[len, heads * d]` of `qkv`'s columns from `first`, as `[1, heads, len, d]`.
fn heads_of(qkv: &Tensor, first: usize, heads: usize) -> Tensor {
    let len = qkv.dim(0).unwrap();
    qkv.narrow(1, first * SHAPE.head_dim, heads * SHAPE.head_dim)
        .unwrap()
        .reshape((1, len, heads, SHAPE.head_dim))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
}

/// candle's way: `rope_i` (or `rope`) on q and k, repeated kv heads, a masked softmax, matmuls.
/// Returns the attention (`[len, heads * d]`) and the rotated keys (`[1, kv_heads, len, d]`).
fn reference(qkv: &Tensor, cos: &Tensor, sin: &Tensor, style: RopeStyle) -> (Tensor, Tensor) {
    let len = qkv.dim(0).unwrap();
    let (cos, sin) = (
        cos.narrow(0, 0, len).unwrap(),
        sin.narrow(0, 0, len).unwrap(),
    );
    let rope = |x: Tensor| match style {
        RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&x, &cos, &sin).unwrap(),
        RopeStyle::Halves => candle_nn::rotary_emb::rope(&x, &cos, &sin).unwrap(),
    };
    let q = rope(heads_of(qkv, 0, SHAPE.heads));
    let k = rope(heads_of(qkv, SHAPE.heads, SHAPE.kv_heads));
    let v = heads_of(qkv, SHAPE.heads + SHAPE.kv_heads, SHAPE.kv_heads);
    let repeat = SHAPE.heads / SHAPE.kv_heads;
    let kr = candle_transformers::utils::repeat_kv(k.clone(), repeat).unwrap();
    let vr = candle_transformers::utils::repeat_kv(v, repeat).unwrap();
    let scores = (q.matmul(&kr.t().unwrap()).unwrap() / (SHAPE.head_dim as f64).sqrt()).unwrap();
    let mask = candle_transformers::utils::build_causal_mask(len, 0, &Device::Cpu).unwrap();
    let minus = Tensor::new(f32::NEG_INFINITY, &Device::Cpu)
        .unwrap()
        .broadcast_as(scores.shape())
        .unwrap();
    let scores = mask
        .broadcast_as(scores.shape())
        .unwrap()
        .where_cond(&minus, &scores)
        .unwrap();
    let y = candle_nn::ops::softmax_last_dim(&scores)
        .unwrap()
        .matmul(&vr)
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .reshape((len, SHAPE.heads * SHAPE.head_dim))
        .unwrap();
    (y, k)
}

/// One sequence's positions `at..at + n` (rows `at..at + n` of `qkv`) through `layer`.
fn pass(qkv: &Tensor, at: usize, n: usize, kv: &mut HostKv, rotary: &Rotary) -> Vec<Vec<f32>> {
    let rows = qkv.narrow(0, at, n).unwrap();
    let mut sequences = [Sequence { row: 0, n, at, kv }];
    layer(&rows, &mut sequences, rotary, SHAPE)
        .unwrap()
        .to_vec2()
        .unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Against candle's rotation (both pairings) and masked-softmax attention, a prompt chunk after
/// a cached prefix; the cached keys are candle's rotated keys bit for bit.
#[test]
fn matches_candles_rotation_and_attention() {
    for style in [RopeStyle::Interleaved, RopeStyle::Halves] {
        matches_candle(style);
    }
}

fn matches_candle(style: RopeStyle) {
    let (at, n) = (7, 5);
    let qkv = random((at + n, WIDTH));
    let (cos, sin, tables) = rotary_styled(40, style);
    let mut kv = HostKv::new(SHAPE, 40);
    pass(&qkv, 0, at, &mut kv, &tables);
    let ours = pass(&qkv, at, n, &mut kv, &tables);
    let (theirs, keys) = reference(&qkv, &cos, &sin, style);
    let theirs = theirs.narrow(0, at, n).unwrap().to_vec2::<f32>().unwrap();
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() < 1e-5,
                "{style:?} position {}: {x} vs {y}",
                at + i
            );
        }
    }
    let keys = keys.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let d = SHAPE.head_dim;
    for h in 0..SHAPE.kv_heads {
        let cached = &kv.heads[h].keys[..(at + n) * d];
        assert_eq!(
            bits(cached),
            bits(&keys[h * (at + n) * d..][..(at + n) * d]),
            "{style:?} kv head {h}"
        );
    }
}

/// A position's output is the same bits computed in one pass of 90, in chunks of 1, 2, 3 ...,
/// or beside another sequence; and a copied prefix continues as the original does.
#[test]
fn a_row_is_the_same_bits_however_its_sequence_is_split_or_batched() {
    let len = 90;
    let qkv = random((len, WIDTH));
    let (_, _, tables) = rotary(len);
    let whole = pass(&qkv, 0, len, &mut HostKv::new(SHAPE, len), &tables);
    let mut kv = HostKv::new(SHAPE, len);
    let (mut at, mut n) = (0, 1);
    while at < len {
        n = n.min(len - at);
        for (i, row) in pass(&qkv, at, n, &mut kv, &tables).iter().enumerate() {
            assert_eq!(bits(row), bits(&whole[at + i]), "position {}", at + i);
        }
        at += n;
        n += 1;
    }
    // Two sequences in one pass: rows 0..30 of another and one decode row of this one after a
    // copied prefix of 60.
    let other = random((30, WIDTH));
    let mut copy = kv.prefix(60, len);
    let mut fresh = HostKv::new(SHAPE, 30);
    let both = Tensor::cat(&[other.clone(), qkv.narrow(0, 60, 1).unwrap()], 0).unwrap();
    let mut sequences = [
        Sequence {
            row: 0,
            n: 30,
            at: 0,
            kv: &mut fresh,
        },
        Sequence {
            row: 30,
            n: 1,
            at: 60,
            kv: &mut copy,
        },
    ];
    let together = layer(&both, &mut sequences, &tables, SHAPE)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert_eq!(
        bits(&together[30]),
        bits(&whole[60]),
        "position 60 after a copied prefix"
    );
    let alone = pass(&other, 0, 30, &mut HostKv::new(SHAPE, 30), &tables);
    for (i, row) in alone.iter().enumerate() {
        assert_eq!(
            bits(&together[i]),
            bits(row),
            "the other sequence's row {i}"
        );
    }
}

/// Tokens beyond a cache's room or the rotary tables, or past what the cache holds, are
/// refused, naming which.
#[test]
fn refuses_tokens_past_the_cache_or_the_context() {
    let qkv = random((4, WIDTH));
    let (_, _, tables) = rotary(16);
    // The error of one step of four tokens from position `at`.
    let refusal = |qkv: &Tensor, kv: &mut HostKv, at: usize| {
        let mut sequences = [Sequence {
            row: 0,
            n: 4,
            at,
            kv,
        }];
        layer(qkv, &mut sequences, &tables, SHAPE)
            .unwrap_err()
            .to_string()
    };
    let e = refusal(&qkv, &mut HostKv::new(SHAPE, 3), 0);
    assert!(e.contains("0..4") && e.contains("cache of 3"), "{e}");
    let mut room = HostKv::new(SHAPE, 32);
    let e = refusal(&qkv, &mut room, 14);
    assert!(e.contains("context of 16"), "{e}");
    let e = refusal(&qkv, &mut room, 5);
    assert!(
        e.contains("starts at position 5 but its cache holds 0"),
        "{e}"
    );
    let e = refusal(&random((4, WIDTH - 1)), &mut room, 0);
    assert!(e.contains("rows of 199"), "{e}");
}

/// A cache made in another sequence's memory (holding more positions than the new one will,
/// of other tokens) answers with the bits a new cache gives: emptied, and holding a copied
/// prefix; emptied for fewer positions, it keeps no more room than that.
#[test]
fn a_cache_in_reused_memory_is_a_new_ones_bits() {
    let len = 40;
    let (_, _, tables) = rotary(len);
    let (qkv, stale) = (random((len, WIDTH)), random((len, WIDTH)));
    let whole = pass(&qkv, 0, len, &mut HostKv::new(SHAPE, len), &tables);
    let mut used = HostKv::new(SHAPE, len);
    pass(&stale, 0, len, &mut used, &tables);
    used.reset(len);
    let emptied = pass(&qkv, 0, 25, &mut used, &tables);
    for (i, row) in emptied.iter().enumerate() {
        assert_eq!(bits(row), bits(&whole[i]), "emptied, position {i}");
    }
    // `used` now holds 25 positions of `qkv`: a copy of 10 of them, in memory holding 40 of
    // `stale` again.
    let mut donor = HostKv::new(SHAPE, len);
    pass(&stale, 0, len, &mut donor, &tables);
    donor.reuse(&used, 10, len);
    let after_copy = pass(&qkv, 10, 5, &mut donor, &tables);
    // Emptied for fewer positions, a cache gives back the room it no longer has to hold.
    let d = SHAPE.head_dim;
    donor.reset(8);
    for h in &donor.heads {
        assert!(h.keys.capacity() < len * d && h.values.capacity() < len * d);
        assert!(h.keys.capacity() >= 8 * d && h.values.capacity() >= 8 * d);
    }
    for (i, row) in after_copy.iter().enumerate() {
        assert_eq!(
            bits(row),
            bits(&whole[10 + i]),
            "after a copied prefix, position {}",
            10 + i
        );
    }
}
