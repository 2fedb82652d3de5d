//! Token hit rate of the memory tier's eviction policies on replayed traces, at equal byte
//! budgets: `cargo bench -p prompt-store --bench hit_rate`.
//!
//! The traces are generated here, seeded, so every run replays the same requests:
//! - skewed: many users' chats, each starting from one of a few shared system prompts and, most
//!   of the time, one of many shared documents, both picked by Zipf (s = 1); several turns per
//!   chat, each turn's prompt extending the previous one; 64 chats interleaved; and bursts of
//!   one-off prompts (batch jobs) that share nothing.
//! - uniform: the same chats with system prompts and documents picked uniformly, and no
//!   one-off prompts: nothing is more popular than anything else, so a frequency-aware policy
//!   has nothing to find and must not lose to LRU.
//!
//! Each request is replayed the way a store serves it: the prompt's chain keys (the store's
//! own `chain_keys`), a lookup of the stored prefix, a read of those blocks (a use), and a put
//! of the blocks that were missing. The token hit rate is the tokens served from the store over
//! the tokens asked for. Every block weighs the same (as a store's blocks do), so the budget is
//! given in blocks: a fraction of the distinct blocks the trace puts.
//!
//! Policies: `lru`, `s3fifo` (one memory tier), and each with admission: the memory tier in
//! front of a farther tier that holds everything (an unbounded memory backend stands in for
//! `dir`, which would measure the disk as well), where a put skips the memory tier and a block
//! enters it when read from the far tier. There the rate is of tokens served by the memory
//! tier itself.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use prompt_store::{chain_keys, Backend, EvictionPolicy, Key, MemoryBackend, TieredBackend};

const BLOCK_TOKENS: usize = 64;
/// Every block's value: its size does not matter when all have one size, only the count.
const VALUE: [u8; 256] = [0; 256];
const REQUESTS: usize = 20_000;

/// xorshift64*: deterministic and enough for picking.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn between(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn tokens(&mut self, n: usize) -> Vec<i32> {
        (0..n).map(|_| (self.next() >> 33) as i32).collect()
    }
}

/// Picks `0..n` with probability proportional to `1 / (i + 1)^s` (s = 0: uniform).
struct Zipf(Vec<f64>);

impl Zipf {
    fn new(n: usize, s: f64) -> Zipf {
        let mut total = 0.0;
        let cdf = (0..n)
            .map(|i| {
                total += 1.0 / ((i + 1) as f64).powf(s);
                total
            })
            .collect::<Vec<_>>();
        Zipf(cdf.into_iter().map(|c| c / total).collect())
    }

    fn pick(&self, rng: &mut Rng) -> usize {
        let u = rng.unit();
        self.0.partition_point(|&c| c < u).min(self.0.len() - 1)
    }
}

struct TraceShape {
    name: &'static str,
    /// Zipf exponent over system prompts and documents.
    skew: f64,
    /// Chance that a request starts a burst of one-off prompts (a batch job) of 100 to 500
    /// prompts.
    bursts: f64,
}

/// The prompts of a trace, in request order.
fn trace(shape: &TraceShape) -> Vec<Vec<i32>> {
    let mut rng = Rng(0x5eed_0000_0000_0040);
    let systems: Vec<Vec<i32>> = (0..8).map(|_| rng.tokens(512)).collect();
    let documents: Vec<Vec<i32>> = (0..300)
        .map(|_| {
            let n = rng.between(1024, 3072);
            rng.tokens(n)
        })
        .collect();
    let (pick_system, pick_document) = (
        Zipf::new(systems.len(), shape.skew),
        Zipf::new(documents.len(), shape.skew),
    );
    // a chat: its prompt so far and the turns left
    let new_chat = |rng: &mut Rng| {
        let mut prompt = systems[pick_system.pick(rng)].clone();
        if rng.unit() < 0.8 {
            prompt.extend(&documents[pick_document.pick(rng)]);
        }
        (prompt, rng.between(1, 6))
    };
    let mut chats: Vec<(Vec<i32>, usize)> = (0..64).map(|_| new_chat(&mut rng)).collect();
    let mut requests = Vec::with_capacity(REQUESTS);
    let mut burst = 0;
    while requests.len() < REQUESTS {
        if burst == 0 && rng.unit() < shape.bursts {
            burst = rng.between(100, 500);
        }
        if burst > 0 {
            burst -= 1;
            let n = rng.between(1024, 4096);
            requests.push(rng.tokens(n));
            continue;
        }
        let i = rng.below(chats.len());
        if chats[i].1 == 0 {
            chats[i] = new_chat(&mut rng);
        }
        // the user's message (after the previous turn's answer)
        let n = rng.between(64, 320);
        let message = rng.tokens(n);
        let chat = &mut chats[i];
        chat.0.extend(message);
        chat.1 -= 1;
        requests.push(chat.0.clone());
    }
    requests
}

/// Tokens served and tokens asked for, replaying `requests` on `store`.
fn replay(store: &dyn Backend, requests: &[Vec<Key>]) -> (u64, u64) {
    let (mut served, mut asked) = (0, 0);
    for keys in requests {
        let stored = store.present_prefix(keys).expect("in memory");
        let read = store.get_many(&keys[..stored]).expect("in memory");
        let hit = read.iter().take_while(|v| v.is_some()).count();
        served += (hit * BLOCK_TOKENS) as u64;
        asked += (keys.len() * BLOCK_TOKENS) as u64;
        let missing: Vec<(Key, &[u8])> = keys[hit..].iter().map(|k| (*k, &VALUE[..])).collect();
        store.put_many(&missing).expect("in memory");
    }
    (served, asked)
}

/// The memory tier's token hit rate with `policy`, alone or in front of a far tier that holds
/// everything, with admission on reuse.
fn hit_rate(requests: &[Vec<Key>], budget: u64, policy: EvictionPolicy, admission: bool) -> f64 {
    let memory = Arc::new(MemoryBackend::with_policy(Some(budget), policy));
    if !admission {
        let (served, asked) = replay(memory.as_ref(), requests);
        return served as f64 / asked as f64;
    }
    let far = Arc::new(MemoryBackend::new(None));
    let tiered = TieredBackend::new(vec![memory, far])
        .expect("two tiers")
        .admit_on_reuse();
    let (_, asked) = replay(&tiered, requests);
    let near_hits = tiered.tier_metrics()[0].hits;
    (near_hits * BLOCK_TOKENS as u64) as f64 / asked as f64
}

/// The token hit rate of Belady's MIN at `budget` blocks: the offline optimum that evicts the
/// block used again farthest in the future (a block never used again first). Replayed as the
/// other policies are (a request is served its stored prefix, then puts what was missing), it
/// bounds what any online policy can reach on the trace.
fn belady(requests: &[Vec<Key>], budget: usize) -> f64 {
    // each block's request indexes, in order
    let mut uses: HashMap<Key, Vec<usize>> = HashMap::new();
    for (t, keys) in requests.iter().enumerate() {
        for k in keys {
            let u = uses.entry(*k).or_default();
            if u.last() != Some(&t) {
                u.push(t);
            }
        }
    }
    let mut cursor: HashMap<Key, usize> = HashMap::new();
    let next_use = |cursor: &mut HashMap<Key, usize>, k: &Key, t: usize| {
        let u = &uses[k];
        let c = cursor.entry(*k).or_default();
        while *c < u.len() && u[*c] <= t {
            *c += 1;
        }
        u.get(*c).copied().unwrap_or(usize::MAX)
    };
    let mut held: HashMap<Key, usize> = HashMap::new();
    let mut by_next: BTreeSet<(usize, Key)> = BTreeSet::new();
    let (mut served, mut asked) = (0u64, 0u64);
    for (t, keys) in requests.iter().enumerate() {
        let hit = keys.iter().take_while(|k| held.contains_key(k)).count();
        served += (hit * BLOCK_TOKENS) as u64;
        asked += (keys.len() * BLOCK_TOKENS) as u64;
        for k in keys {
            let n = next_use(&mut cursor, k, t);
            if let Some(old) = held.insert(*k, n) {
                by_next.remove(&(old, *k));
            }
            by_next.insert((n, *k));
        }
        while held.len() > budget {
            let (_, k) = by_next.pop_last().expect("held");
            held.remove(&k);
        }
    }
    served as f64 / asked as f64
}

fn main() {
    let shapes = [
        TraceShape {
            name: "skewed",
            skew: 1.0,
            bursts: 0.001,
        },
        TraceShape {
            name: "uniform",
            skew: 0.0,
            bursts: 0.0,
        },
    ];
    let root = Key([0x40; 32]);
    for shape in &shapes {
        let requests: Vec<Vec<Key>> = trace(shape)
            .iter()
            .map(|t| chain_keys(&root, t, BLOCK_TOKENS))
            .collect();
        let distinct = requests.iter().flatten().collect::<HashSet<_>>().len();
        let tokens: usize = requests.iter().map(|k| k.len() * BLOCK_TOKENS).sum();
        println!(
            "\n{} trace: {REQUESTS} requests, {tokens} tokens in full blocks, {distinct} distinct blocks of {BLOCK_TOKENS} tokens",
            shape.name
        );
        println!(
            "| budget (share of distinct blocks) | lru | s3fifo | s3fifo / lru | lru + admission | s3fifo + admission | optimum (Belady) | optimum / lru |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        for share in [0.005, 0.01, 0.02, 0.05, 0.2] {
            let budget = (distinct as f64 * share) as u64 * VALUE.len() as u64;
            let rate = |p, a| hit_rate(&requests, budget, p, a);
            let (lru, s3) = (
                rate(EvictionPolicy::Lru, false),
                rate(EvictionPolicy::S3Fifo, false),
            );
            let best = belady(&requests, (distinct as f64 * share) as usize);
            println!(
                "| {}% | {:.1}% | {:.1}% | {:.2}x | {:.1}% | {:.1}% | {:.1}% | {:.2}x |",
                share * 100.0,
                lru * 100.0,
                s3 * 100.0,
                s3 / lru,
                rate(EvictionPolicy::Lru, true) * 100.0,
                rate(EvictionPolicy::S3Fifo, true) * 100.0,
                best * 100.0,
                best / lru,
            );
        }
    }
}
