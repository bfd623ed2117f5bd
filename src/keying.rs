//! Prefix keys, shards and partitions: which requests belong together and where they go.
//!
//! Everything here is pure and deterministic across instances, releases and platforms: hashes are
//! `xxh3_64` with fixed seeds (never `std`'s `DefaultHasher`, whose output may change between
//! Rust releases), and integers are hashed in little-endian byte order.
//!
//! - key: `xxh3_64(material, KEY_SEED)` where material is the explicit `prefix_key`, else the chat
//!   key material, else the first `prefix_chars` characters of the completions prompt.
//! - key levels ([`level_key`]): the same hash over longer and longer material, from level 0 (the
//!   key above) to the finest level ([`level_count`]):
//!
//!   | request | level 0 | level 1 | level 2 | level 3 |
//!   | --- | --- | --- | --- | --- |
//!   | completions | first `prefix_chars` (256) chars | first 4 × `prefix_chars` (1 024) | 16 × (4 096) | 64 × (16 384) |
//!   | chat, `chat_key = "opening"` (default) | first `prefix_chars` chars of the opening | 4 × | 16 × | 64 ×; level 4: through the second user message |
//!   | chat, `chat_key = "system"` or `"rendered"` | `chat_key` material | through the first user message | through the second user message | — |
//!   | chat, `chat_key = "system_and_first_user"` | its material (through the first user message) | through the second user message | through the third user message | — |
//!   | explicit `prefix_key` | the key | — | — | — |
//!
//!   Chat levels are role-tagged renderings ([`render_chat`]) of the leading messages. The
//!   opening is the leading system/developer messages and the first user message: constant over
//!   all turns of a conversation, so a conversation keeps one partition at every level cut from
//!   it, and cut by length it groups conversations whose system prompts share a long start. The
//!   level through the second user turn tells apart conversations that open with the same template
//!   question. Material shorter than a level is used whole at that level and deeper, so such
//!   requests keep their key when their key is split.
//! - shard: uniform at random in `0..shards(key)`.
//! - partition: `xxh3_64(key_le ‖ shard_le, PARTITION_SEED) mod P`.
//! - rendezvous (HRW) hashing: the winner among members for an item is the member with the highest
//!   `xxh3_64(item_le ‖ member, HRW_SEED)` (Thaler & Ravishankar, 1998).
//! - assignment: the desired owner of every partition, rendezvous hashing with bounded loads over
//!   the live member names ([`assignment`], [`desired_partitions`]).

use std::collections::BTreeSet;
use std::fmt;
use std::num::NonZeroU32;

use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

use crate::config::{ChatKey, KeyingSettings, ShardingSettings};
use crate::request::{render_chat, Body, ChatMessage, Request};

/// Seed of the prefix-key hash. Changing it re-keys every deployment: never change it.
pub const KEY_SEED: u64 = 0x7072_6566_6978_6b65; // "prefixke"
/// Seed of the partition hash.
pub const PARTITION_SEED: u64 = 0x7061_7274_6974_696f; // "partitio"
/// Seed of rendezvous hashing (partition owners, LLM endpoints).
pub const HRW_SEED: u64 = 0x7265_6e64_657a_766f; // "rendezvo"

/// Characters of key material shown in logs.
pub const MATERIAL_PREVIEW_CHARS: usize = 40;

/// A 64-bit prefix key. Displayed as 16 lowercase hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PrefixKey(pub u64);

impl PrefixKey {
    /// Hashes key material.
    pub fn of(material: &str) -> Self {
        PrefixKey(xxh3_64_with_seed(material.as_bytes(), KEY_SEED))
    }
}

impl fmt::Display for PrefixKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// Where a key came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySource {
    /// The request's `prefix_key` field or `x-prefix-key` header.
    Explicit,
    /// Derived from chat messages.
    Chat,
    /// Derived from a completions prompt.
    Completion,
}

/// A derived key with the material it was computed from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyedRequest {
    pub key: PrefixKey,
    pub source: KeySource,
    /// The full key material (the explicit key, or the prompt prefix).
    pub material: String,
}

impl KeyedRequest {
    /// The first [`MATERIAL_PREVIEW_CHARS`] characters of the material, for logs.
    pub fn preview(&self) -> &str {
        prefix_chars(&self.material, MATERIAL_PREVIEW_CHARS)
    }
}

/// The first `n` Unicode scalar values of `s` (all of `s` when shorter).
pub fn prefix_chars(s: &str, n: usize) -> &str {
    // A string of at most `n` bytes has at most `n` characters; `n` ASCII bytes are `n`
    // characters and end on a character boundary. Both skip decoding the characters one by one
    // (prompts are mostly ASCII, and a key level can be 16,384 characters long).
    if s.len() <= n {
        return s;
    }
    if s.as_bytes()[..n].is_ascii() {
        return &s[..n];
    }
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// Derives the prefix key of a request: explicit > chat > completions (DESIGN §3).
///
/// Chat messages are validated at parse time, so derivation cannot fail.
pub fn derive_key(req: &Request, cfg: &KeyingSettings) -> KeyedRequest {
    if let Some(k) = &req.prefix_key {
        return KeyedRequest { key: PrefixKey::of(k), source: KeySource::Explicit, material: k.clone() };
    }
    let (material, source) = match &req.body {
        Body::Completion(p) => (prefix_chars(p, cfg.prefix_chars.get()).to_owned(), KeySource::Completion),
        Body::Chat(msgs) => (chat_material(msgs, cfg), KeySource::Chat),
    };
    KeyedRequest { key: PrefixKey::of(&material), source, material }
}

fn chat_material(msgs: &[ChatMessage], cfg: &KeyingSettings) -> String {
    let n = cfg.prefix_chars.get();
    let leading_system = msgs.iter().take_while(|m| m.role == "system" || m.role == "developer").count();
    match cfg.chat_key {
        ChatKey::Opening => render_chat(&msgs[..opening_end(msgs)], n),
        ChatKey::Rendered => render_chat(msgs, n),
        ChatKey::System if leading_system > 0 => render_chat(&msgs[..leading_system], usize::MAX),
        ChatKey::SystemAndFirstUser => {
            let end = msgs[leading_system..]
                .iter()
                .position(|m| m.role == "user")
                .map_or(leading_system, |i| leading_system + i + 1);
            render_chat(&msgs[..end], usize::MAX)
        }
        ChatKey::System => match msgs.iter().find(|m| m.role == "user") {
            Some(u) => render_chat(std::slice::from_ref(u), n + "<|user|>\n".len()),
            None => render_chat(msgs, n),
        },
    }
}

/// End (exclusive index) of a conversation's opening: its leading system/developer messages and
/// the first user message after them; all messages when there is no user message. Every later
/// turn of the conversation repeats the opening verbatim.
fn opening_end(msgs: &[ChatMessage]) -> usize {
    let leading_system = msgs.iter().take_while(|m| m.role == "system" || m.role == "developer").count();
    msgs[leading_system..].iter().position(|m| m.role == "user").map_or(msgs.len(), |i| leading_system + i + 1)
}

/// Key levels of a completions prompt (level `i` is the first `prefix_chars × 4^i` characters).
pub const COMPLETION_LEVELS: u8 = 4;
/// Key levels of a chat request keyed by its opening (`chat_key = "opening"`, the default): the
/// first `prefix_chars × 4^i` characters of the rendered opening for `i` in 0..4, then the
/// conversation through the second user message.
pub const OPENING_LEVELS: u8 = COMPLETION_LEVELS + 1;
/// Key levels of a chat request with another `chat_key` (its material; through the first user
/// message; through the second user message; for `system_and_first_user`, whose material runs
/// through the first user message: its material; through the second; through the third).
pub const CHAT_LEVELS: u8 = 3;
/// Growth of the completions key material from one level to the next.
pub const LEVEL_GROWTH: usize = 4;

/// Number of key levels of `req`: 1 for an explicit key (it cannot be split by content),
/// [`OPENING_LEVELS`] for chat keyed by its opening, [`CHAT_LEVELS`] for chat keyed otherwise,
/// [`COMPLETION_LEVELS`] for completions. The finest level is `level_count - 1`.
pub fn level_count(req: &Request, cfg: &KeyingSettings) -> u8 {
    match (&req.prefix_key, &req.body) {
        (Some(_), _) => 1,
        (None, Body::Chat(_)) if cfg.chat_key == ChatKey::Opening => OPENING_LEVELS,
        (None, Body::Chat(_)) => CHAT_LEVELS,
        (None, Body::Completion(_)) => COMPLETION_LEVELS,
    }
}

/// Characters of level `level`'s material in the character-cut levels: `prefix_chars × 4^level`.
fn level_chars(cfg: &KeyingSettings, level: u8) -> usize {
    cfg.prefix_chars.get().saturating_mul(LEVEL_GROWTH.saturating_pow(u32::from(level)))
}

/// The key of `req` at `level` (see the module doc for the levels); `None` when `level >=`
/// [`level_count`]. Level 0 equals [`derive_key`]'s key. Completions keys hash a slice of the
/// prompt and chat keys of level ≥ 1 hash the rendering as it streams, so nothing is allocated
/// apart from level 0 of chat.
pub fn level_key(req: &Request, cfg: &KeyingSettings, level: u8) -> Option<PrefixKey> {
    if level >= level_count(req, cfg) {
        return None;
    }
    if let Some(k) = &req.prefix_key {
        return Some(PrefixKey::of(k));
    }
    Some(match (&req.body, level) {
        (Body::Completion(p), l) => PrefixKey::of(prefix_chars(p, level_chars(cfg, l))),
        (Body::Chat(msgs), l) if cfg.chat_key == ChatKey::Opening && l < COMPLETION_LEVELS => {
            rendered_prefix_key(&msgs[..opening_end(msgs)], level_chars(cfg, l))
        }
        (Body::Chat(msgs), _) if cfg.chat_key == ChatKey::Opening => chat_turns_key(msgs, 2),
        (Body::Chat(msgs), 0) => PrefixKey::of(&chat_material(msgs, cfg)),
        // Its material already runs through the first user message: a level through that
        // message would be the same key, and a split by it would move nothing.
        (Body::Chat(msgs), l) if cfg.chat_key == ChatKey::SystemAndFirstUser => chat_turns_key(msgs, usize::from(l) + 1),
        (Body::Chat(msgs), l) => chat_turns_key(msgs, usize::from(l)),
    })
}

/// Key of the first `max_chars` characters of [`render_chat`]`(msgs)`, hashed as it streams
/// (equal to `PrefixKey::of(&render_chat(msgs, max_chars))` without building the string).
fn rendered_prefix_key(msgs: &[ChatMessage], max_chars: usize) -> PrefixKey {
    let mut h = Xxh3::with_seed(KEY_SEED);
    let mut left = max_chars;
    'outer: for m in msgs {
        for part in ["<|", m.role.as_str(), "|>\n", m.text.as_str(), "\n"] {
            match part.char_indices().nth(left) {
                Some((cut, _)) => {
                    h.update(&part.as_bytes()[..cut]);
                    break 'outer;
                }
                None => {
                    h.update(part.as_bytes());
                    left -= part.chars().count();
                }
            }
        }
    }
    PrefixKey(h.digest())
}

/// Key of the chat messages up to and including the `users`-th user message (all messages when
/// there are fewer), hashed as [`render_chat`] would render them.
fn chat_turns_key(msgs: &[ChatMessage], users: usize) -> PrefixKey {
    let mut seen = 0;
    let end = msgs
        .iter()
        .position(|m| {
            seen += usize::from(m.role == "user");
            seen == users
        })
        .map_or(msgs.len(), |i| i + 1);
    let mut h = Xxh3::with_seed(KEY_SEED);
    for m in &msgs[..end] {
        for part in ["<|", m.role.as_str(), "|>\n", m.text.as_str(), "\n"] {
            h.update(part.as_bytes());
        }
    }
    PrefixKey(h.digest())
}

/// Number of shards of a key: the per-key table (by explicit key or key hex), then the first
/// matching pattern rule (matched against the explicit key or the key material), then
/// `default_shards`.
pub fn shards_for(k: &KeyedRequest, cfg: &ShardingSettings) -> NonZeroU32 {
    static_shards(k, cfg).unwrap_or(cfg.default_shards)
}

/// The static shard count of a key, when the per-key table or a pattern rule names it (the
/// override of both the static and the adaptive mode); `None` otherwise.
pub fn static_shards(k: &KeyedRequest, cfg: &ShardingSettings) -> Option<NonZeroU32> {
    if let Some(n) = cfg.keys.get(&k.material).or_else(|| cfg.keys.get(&k.key.to_string())) {
        return Some(*n);
    }
    cfg.rules.iter().find(|r| r.pattern.is_match(&k.material)).map(|r| r.shards)
}

/// Picks a shard uniformly at random in `0..shards`.
pub fn pick_shard(shards: NonZeroU32) -> u32 {
    fastrand::u32(0..shards.get())
}

/// Partition of (key, shard): `xxh3_64(key_le ‖ shard_le, PARTITION_SEED) mod partitions`.
pub fn partition_of(key: PrefixKey, shard: u32, partitions: NonZeroU32) -> u32 {
    let mut buf = [0u8; 12];
    buf[..8].copy_from_slice(&key.0.to_le_bytes());
    buf[8..].copy_from_slice(&shard.to_le_bytes());
    (xxh3_64_with_seed(&buf, PARTITION_SEED) % u64::from(partitions.get())) as u32
}

/// Rendezvous (HRW) score of `member` for `item`.
pub fn hrw_score(item: u64, member: &str) -> u64 {
    let mut buf = Vec::with_capacity(8 + member.len());
    buf.extend_from_slice(&item.to_le_bytes());
    buf.extend_from_slice(member.as_bytes());
    xxh3_64_with_seed(&buf, HRW_SEED)
}

/// Index of the member with the highest [`hrw_score`] for `item` (ties: the smaller name wins);
/// `None` when `members` is empty.
pub fn hrw_pick<S: AsRef<str>>(item: u64, members: &[S]) -> Option<usize> {
    members
        .iter()
        .enumerate()
        .max_by(|(_, a), (_, b)| {
            let (a, b) = (a.as_ref(), b.as_ref());
            hrw_score(item, a).cmp(&hrw_score(item, b)).then_with(|| b.cmp(a))
        })
        .map(|(i, _)| i)
}

/// The desired owner of every partition: rendezvous (HRW) hashing with bounded loads.
///
/// Returns, for each partition `0..partitions`, the index into `members` of its desired owner
/// (`None` only when `members` is empty). Every (partition, member) pair is scored with
/// [`hrw_score`]; pairs are taken from the highest score down, and a pair is assigned when its
/// partition is still free and its member still has room. Each member has room for ⌊P/M⌋
/// partitions, and ⌈P/M⌉ for the first `P mod M` members that ask for one more, so the total
/// room is exactly `P`: every partition gets an owner and loads differ by at most one.
///
/// Why not plain HRW (each partition to its top-scoring member): its load per member is
/// binomial, with a standard deviation of √(P·(1/M)·(1−1/M)) — 2.3 partitions for P = 24, M = 3
/// — so one member in three or four deployments owns a third more than its share. Bounding the
/// loads keeps HRW's properties that matter here: the answer depends only on the set of names
/// (not their order, not on any coordinator), so every instance computes the same one and a
/// restarted instance with the same name gets the same partitions back; and a join or leave
/// moves few partitions (measured for P = 24…64, M = 3…8: 1.2–1.5× the minimum P/M, against
/// exactly P/M for plain HRW).
///
/// Cost: O(P·M·log(P·M)), a few microseconds per tick for P = 64, M = 8.
pub fn assignment<S: AsRef<str>>(partitions: u32, members: &[S]) -> Vec<Option<usize>> {
    let mut owner = vec![None; partitions as usize];
    let m = members.len();
    if m == 0 {
        return owner;
    }
    let base = partitions as usize / m;
    let mut extra = partitions as usize % m;
    let mut pairs: Vec<(u64, u32, usize)> = Vec::with_capacity(partitions as usize * m);
    for p in 0..partitions {
        for (i, name) in members.iter().enumerate() {
            pairs.push((hrw_score(u64::from(p), name.as_ref()), p, i));
        }
    }
    // Highest score first; ties (practically impossible with 64-bit scores) by partition, then
    // by name, so the order is total and independent of the order of `members`.
    pairs.sort_unstable_by(|a, b| {
        b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then_with(|| members[a.2].as_ref().cmp(members[b.2].as_ref()))
    });
    let mut load = vec![0usize; m];
    let mut left = partitions as usize;
    for (_, p, i) in pairs {
        if left == 0 {
            break;
        }
        if owner[p as usize].is_some() {
            continue;
        }
        if load[i] < base || (load[i] == base && extra > 0) {
            if load[i] == base {
                extra -= 1;
            }
            load[i] += 1;
            owner[p as usize] = Some(i);
            left -= 1;
        }
    }
    owner
}

/// Partitions whose desired owner ([`assignment`]) among `members` is `me`.
pub fn desired_partitions(partitions: u32, members: &[String], me: &str) -> BTreeSet<u32> {
    assignment(partitions, members)
        .into_iter()
        .enumerate()
        .filter(|(_, o)| o.is_some_and(|i| members[i] == me))
        .map(|(p, _)| p as u32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{KeyingMode, ShardRule};
    use crate::request::{parse, Envelope};
    use std::collections::HashMap;
    use std::num::NonZeroUsize;

    fn kcfg(prefix_chars: usize, chat_key: ChatKey) -> KeyingSettings {
        KeyingSettings { mode: KeyingMode::Prefix, prefix_chars: NonZeroUsize::new(prefix_chars).unwrap(), chat_key }
    }

    fn req(json: &str) -> Request {
        parse(json.as_bytes(), &Envelope::default(), 1 << 20).unwrap()
    }

    /// Derives the keys of `same` (two requests that must share a key) and of `other` (which
    /// must not share it) and returns the derivation of `same[0]`.
    fn shared_key(c: &KeyingSettings, same: [&str; 2], other: &str) -> KeyedRequest {
        let a = derive_key(&req(same[0]), c);
        let b = derive_key(&req(same[1]), c);
        let d = derive_key(&req(other), c);
        assert_eq!(a.key, b.key);
        assert_ne!(a.key, d.key);
        a
    }

    #[test]
    fn completions_key_uses_first_prefix_chars() {
        let c = kcfg(5, ChatKey::System);
        let a = shared_key(
            &c,
            [
                r#"{"prompt":"Hello world"}"#,
                r#"{"prompt":"Hello there"}"#,
            ],
            r#"{"prompt":"Help me"}"#,
        );
        assert_eq!(a.material, "Hello");
        assert_eq!(a.source, KeySource::Completion);
    }

    #[test]
    fn prefix_counts_unicode_scalar_values_not_bytes() {
        let c = kcfg(3, ChatKey::System);
        let a = derive_key(&req(r#"{"prompt":"日本語のテキスト"}"#), &c);
        assert_eq!(a.material, "日本語");
        let b = derive_key(&req(r#"{"prompt":"日本語です"}"#), &c);
        assert_eq!(a.key, b.key);
        assert_eq!(prefix_chars("é😀x", 2), "é😀");
        assert_eq!(prefix_chars("ab", 5), "ab");
    }

    #[test]
    fn prefix_chars_agrees_with_counting_characters_one_by_one() {
        let naive = |s: &str, n: usize| -> String { s.chars().take(n).collect() };
        for s in ["", "abc", "abcé", "éabc", "ab😀cd", "日本語のテキスト", "plain ascii text", "x\u{0}y"] {
            for n in 0..=s.len() + 1 {
                assert_eq!(prefix_chars(s, n), naive(s, n), "{s:?}, {n}");
            }
        }
    }

    #[test]
    fn explicit_key_wins() {
        let c = kcfg(5, ChatKey::System);
        let a = derive_key(&req(r#"{"prompt":"Hello world","prefix_key":"tenant-1"}"#), &c);
        let b = derive_key(&req(r#"{"messages":[{"role":"user","content":"x"}],"prefix_key":"tenant-1"}"#), &c);
        assert_eq!(a.key, b.key);
        assert_eq!(a.source, KeySource::Explicit);
        assert_eq!(a.key, PrefixKey::of("tenant-1"));
    }

    #[test]
    fn chat_system_mode_keys_on_leading_system_and_developer_messages() {
        let c = kcfg(4, ChatKey::System);
        let a = shared_key(
            &c,
            [
                r#"{"messages":[{"role":"system","content":"S1"},{"role":"developer","content":"D"},{"role":"user","content":"q1"}]}"#,
                r#"{"messages":[{"role":"system","content":"S1"},{"role":"developer","content":"D"},{"role":"user","content":"q2"}]}"#,
            ],
            r#"{"messages":[{"role":"system","content":"S2"},{"role":"user","content":"q1"}]}"#,
        );
        assert_eq!(a.source, KeySource::Chat);
        // The whole system prompt counts, not just prefix_chars of it.
        assert_eq!(a.material, "<|system|>\nS1\n<|developer|>\nD\n");
    }

    #[test]
    fn chat_system_mode_without_system_uses_first_user_prefix() {
        let c = kcfg(4, ChatKey::System);
        let a = shared_key(
            &c,
            [
                r#"{"messages":[{"role":"user","content":"abcdXYZ"}]}"#,
                r#"{"messages":[{"role":"user","content":"abcdQRS"}]}"#,
            ],
            r#"{"messages":[{"role":"user","content":"abceQRS"}]}"#,
        );
        assert_eq!(a.material, "<|user|>\nabcd");
    }

    #[test]
    fn chat_system_and_first_user_mode() {
        let c = kcfg(4, ChatKey::SystemAndFirstUser);
        let a = shared_key(
            &c,
            [
                r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"u1"},{"role":"assistant","content":"x"}]}"#,
                r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"u1"},{"role":"assistant","content":"y"}]}"#,
            ],
            r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"u2"}]}"#,
        );
        assert_eq!(a.material, "<|system|>\nS\n<|user|>\nu1\n");
    }

    #[test]
    fn chat_rendered_mode_uses_role_tagged_prefix() {
        let c = kcfg(12, ChatKey::Rendered);
        let a = derive_key(&req(r#"{"messages":[{"role":"system","content":"ABC"},{"role":"user","content":"q1"}]}"#), &c);
        assert_eq!(a.material, "<|system|>\nA");
        let b = derive_key(&req(r#"{"messages":[{"role":"user","content":"ABC"}]}"#), &c);
        assert_ne!(a.key, b.key, "roles are part of the rendered material");
    }

    #[test]
    fn completion_levels_grow_by_four_and_short_prompts_keep_their_key() {
        let c = kcfg(4, ChatKey::System);
        let long = format!("abcd{}", "x".repeat(300));
        let r = req(&format!(r#"{{"prompt":"{long}"}}"#));
        assert_eq!(level_count(&r, &c), COMPLETION_LEVELS);
        assert_eq!(level_key(&r, &c, 0), Some(derive_key(&r, &c).key));
        for (level, chars) in [(1u8, 16usize), (2, 64), (3, 256)] {
            assert_eq!(level_key(&r, &c, level), Some(PrefixKey::of(&long[..chars])), "level {level}");
        }
        assert_eq!(level_key(&r, &c, 4), None);
        let short = req(r#"{"prompt":"abcdefg"}"#);
        let (l1, l2) = (level_key(&short, &c, 1), level_key(&short, &c, 2));
        assert_eq!(l1, Some(PrefixKey::of("abcdefg")));
        assert_eq!(l1, l2, "shorter than a level: the whole prompt there and deeper");
    }

    #[test]
    fn chat_levels_follow_the_conversation() {
        let c = kcfg(256, ChatKey::System);
        let turn1 = req(r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"u1"}]}"#);
        let turn2 = req(r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"u1"},{"role":"assistant","content":"a1"},{"role":"user","content":"u2"}]}"#);
        let turn3 = req(r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"u1"},{"role":"assistant","content":"a1"},{"role":"user","content":"u2"},{"role":"assistant","content":"a2"},{"role":"user","content":"u3"}]}"#);
        let other = req(r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"v1"}]}"#);
        assert_eq!(level_count(&turn1, &c), CHAT_LEVELS);
        let k = |r: &Request, l| level_key(r, &c, l).unwrap();
        // Level 0: the system prompt, shared by all.
        assert!([&turn2, &turn3, &other].iter().all(|r| k(r, 0) == k(&turn1, 0)));
        // Level 1: the conversation's opening, the same over all its turns.
        assert!(k(&turn1, 1) == k(&turn2, 1) && k(&turn2, 1) == k(&turn3, 1));
        assert_ne!(k(&turn1, 1), k(&other, 1));
        let Body::Chat(msgs) = &turn3.body else { unreachable!() };
        assert_eq!(k(&turn3, 2), PrefixKey::of(&render_chat(&msgs[..4], usize::MAX)), "streamed hash = hash of the rendering");
        assert_eq!(k(&turn1, 1), PrefixKey::of("<|system|>\nS\n<|user|>\nu1\n"), "hashes the rendering");
        // Level 2: through the second user turn.
        assert_eq!(k(&turn2, 2), k(&turn3, 2));
        assert_ne!(k(&turn1, 2), k(&turn2, 2));
        assert_eq!(k(&turn1, 2), k(&turn1, 1), "one user turn: the whole conversation");
        assert_eq!(level_key(&turn1, &c, 3), None);

        // Keyed through the first user message already: each deeper level adds a user turn, so
        // no two levels of a conversation with more turns share a key (a split moves it).
        let c = kcfg(4, ChatKey::SystemAndFirstUser);
        let k = |r: &Request, l| level_key(r, &c, l).unwrap();
        assert_eq!(k(&turn3, 0), k(&turn1, 0));
        assert_eq!(k(&turn3, 0), PrefixKey::of("<|system|>\nS\n<|user|>\nu1\n"));
        assert_ne!(k(&turn3, 1), k(&turn3, 0), "level 1 goes through the second user turn");
        assert_eq!(k(&turn3, 1), k(&turn2, 1));
        assert_eq!(k(&turn3, 1), PrefixKey::of(&render_chat(&msgs[..4], usize::MAX)));
        assert_ne!(k(&turn3, 2), k(&turn3, 1), "level 2 goes through the third");
        assert_eq!(k(&turn3, 2), PrefixKey::of(&render_chat(msgs, usize::MAX)));
        assert_eq!(level_key(&turn3, &c, 3), None);
    }

    #[test]
    fn opening_levels_cut_the_opening_like_a_prompt_then_add_the_second_turn() {
        let c = kcfg(4, ChatKey::Opening);
        // Two conversations whose system prompts share their first 20 characters.
        let sys_a = format!("{}{}", "t".repeat(20), "alpha tools");
        let sys_b = format!("{}{}", "t".repeat(20), "beta tools");
        let chat = |sys: &str, turns: &[&str]| {
            let mut msgs = vec![serde_json::json!({"role": "system", "content": sys})];
            for (i, u) in turns.iter().enumerate() {
                if i > 0 {
                    msgs.push(serde_json::json!({"role": "assistant", "content": "ok"}));
                }
                msgs.push(serde_json::json!({"role": "user", "content": u}));
            }
            req(&serde_json::json!({ "messages": msgs }).to_string())
        };
        let (a1, a2, a3) = (chat(&sys_a, &["u1"]), chat(&sys_a, &["u1", "u2"]), chat(&sys_a, &["u1", "u2", "u3"]));
        let b1 = chat(&sys_b, &["u1"]);
        assert_eq!(level_count(&a1, &c), OPENING_LEVELS);
        let k = |r: &Request, l| level_key(r, &c, l).unwrap();
        let opening = "<|system|>\n".to_owned() + &sys_a + "\n<|user|>\nu1\n";
        for (level, chars) in [(0u8, 4usize), (1, 16), (2, 64), (3, 256)] {
            let cut: String = opening.chars().take(chars).collect();
            assert_eq!(k(&a1, level), PrefixKey::of(&cut), "level {level}: the first {chars} characters of the opening");
            assert!(k(&a2, level) == k(&a1, level) && k(&a3, level) == k(&a1, level), "level {level} is the same over the turns");
        }
        assert_eq!(k(&a1, 0), derive_key(&a1, &c).key, "level 0 is the derived key");
        // Shared system text: one key while the cut stays inside it, two keys once it reaches the difference.
        assert_eq!(k(&a1, 1), k(&b1, 1));
        assert_ne!(k(&a1, 2), k(&b1, 2));
        // The finest level adds the second user turn.
        assert_eq!(k(&a2, 4), k(&a3, 4));
        assert_ne!(k(&a1, 4), k(&a2, 4));
        assert_eq!(level_key(&a1, &c, 5), None);
        // Multi-byte characters count as one each, and the streamed hash equals the rendered one.
        let u = chat("ééé", &["ü"]);
        let Body::Chat(msgs) = &u.body else { unreachable!() };
        assert_eq!(k(&u, 1), PrefixKey::of(&render_chat(msgs, 16)));
        assert_eq!(derive_key(&u, &c).material, "<|sy");
    }

    #[test]
    fn an_explicit_key_has_one_level() {
        let c = kcfg(4, ChatKey::System);
        let r = req(r#"{"prompt":"Hello world","prefix_key":"tenant-1"}"#);
        assert_eq!(level_count(&r, &c), 1);
        assert_eq!(level_key(&r, &c, 0), Some(PrefixKey::of("tenant-1")));
        assert_eq!(level_key(&r, &c, 1), None);
    }

    #[test]
    fn unknown_message_schema_is_an_error_not_a_shared_key() {
        let err = parse(br#"{"messages":[{"role":"user","content":{"image":1}}]}"#, &Envelope::default(), 1000);
        assert_eq!(err.unwrap_err().reason(), "unknown_message_schema");
    }

    /// Pinned values: a change here re-keys and re-partitions every deployment. Never update these
    /// numbers without a migration plan.
    #[test]
    fn hashes_are_pinned() {
        assert_eq!(PrefixKey::of("").to_string(), format!("{:016x}", xxh3_64_with_seed(b"", KEY_SEED)));
        let k = PrefixKey::of("Evaluate the result of a random Boolean expression.");
        assert_eq!(k.to_string(), "c934e2bc27728a8a");
        let p = NonZeroU32::new(64).unwrap();
        let parts: Vec<u32> = (0..8).map(|s| partition_of(k, s, p)).collect();
        assert_eq!(parts, vec![44, 2, 24, 24, 34, 1, 57, 37]);
        assert_eq!(partition_of(PrefixKey(0), 0, p), 61);
        assert_eq!(partition_of(PrefixKey(u64::MAX), 7, NonZeroU32::new(1000).unwrap()), 65);
        assert_eq!(hrw_score(3, "node-a"), 0x19ac_3249_961a_e743);
        assert_eq!(hrw_pick(3, &["node-a", "node-b", "node-c"]), Some(2));
    }

    #[test]
    fn partition_is_in_range_and_spreads() {
        let p = NonZeroU32::new(64).unwrap();
        let mut seen = vec![0usize; 64];
        for i in 0..64_000u64 {
            let part = partition_of(PrefixKey(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)), (i % 8) as u32, p);
            seen[part as usize] += 1;
        }
        assert!(seen.iter().all(|&n| (800..1200).contains(&n)), "{seen:?}");
    }

    #[test]
    fn hrw_moves_only_the_leaving_members_items() {
        let before = ["a", "b", "c", "d"];
        let after = ["a", "b", "d"];
        for item in 0..1000u64 {
            let was = before[hrw_pick(item, &before).unwrap()];
            let now = after[hrw_pick(item, &after).unwrap()];
            if was != "c" {
                assert_eq!(was, now, "item {item} moved although its owner stayed");
            }
        }
        assert_eq!(hrw_pick::<&str>(1, &[]), None);
    }

    #[test]
    fn shard_table_then_rules_then_default() {
        let n = |v| NonZeroU32::new(v).unwrap();
        let cfg = ShardingSettings {
            default_shards: n(8),
            max_shards: n(8),
            keys: HashMap::from([("tenant-1".to_string(), n(2))]),
            rules: vec![ShardRule { pattern: regex::Regex::new("^Evaluate").unwrap(), shards: n(3) }],
        };
        let c = kcfg(20, ChatKey::System);
        assert_eq!(shards_for(&derive_key(&req(r#"{"prompt":"x","prefix_key":"tenant-1"}"#), &c), &cfg), n(2));
        assert_eq!(shards_for(&derive_key(&req(r#"{"prompt":"Evaluate this"}"#), &c), &cfg), n(3));
        let other = derive_key(&req(r#"{"prompt":"Other"}"#), &c);
        assert_eq!(shards_for(&other, &cfg), n(8));
        let by_hex = ShardingSettings { keys: HashMap::from([(other.key.to_string(), n(5))]), ..cfg };
        assert_eq!(shards_for(&other, &by_hex), n(5));
        for _ in 0..100 {
            assert!(pick_shard(n(3)) < 3);
        }
    }

    // Partition assignment.

    fn names(prefix: &str, n: usize) -> Vec<String> {
        (0..n).map(|i| format!("{prefix}-{i}")).collect()
    }

    fn loads(owner: &[Option<usize>], m: usize) -> Vec<usize> {
        let mut l = vec![0; m];
        for o in owner {
            l[o.expect("every partition has an owner")] += 1;
        }
        l
    }

    #[test]
    fn every_partition_gets_one_owner_and_loads_differ_by_at_most_one() {
        for p in [1u32, 7, 16, 24, 64, 100] {
            for m in 1..=9 {
                let members = names(&format!("host{p}x{m}"), m);
                let l = loads(&assignment(p, &members), m);
                assert_eq!(l.iter().sum::<usize>(), p as usize);
                let (lo, hi) = (*l.iter().min().unwrap(), *l.iter().max().unwrap());
                assert!(hi - lo <= 1, "P={p} M={m}: loads {l:?}");
            }
        }
        assert!(assignment(8, &Vec::<String>::new()).iter().all(Option::is_none));
    }

    #[test]
    fn assignment_depends_on_the_set_of_names_only() {
        let members = names("node", 5);
        let mut shuffled = members.clone();
        shuffled.reverse();
        shuffled.swap(0, 2);
        let by_name = |ms: &[String]| -> Vec<String> { assignment(64, ms).into_iter().map(|o| ms[o.unwrap()].clone()).collect() };
        assert_eq!(by_name(&members), by_name(&shuffled));
        for me in &members {
            assert_eq!(desired_partitions(64, &members, me), desired_partitions(64, &shuffled, me));
        }
    }

    /// A join or a leave moves few partitions: at most twice the unavoidable share (measured
    /// 1.2–1.5× on average, see [`assignment`]).
    #[test]
    fn join_and_leave_move_few_partitions_and_rejoin_restores() {
        for (p, m) in [(24u32, 3usize), (32, 4), (64, 3), (64, 8)] {
            for trial in 0..20 {
                let before = names(&format!("t{trial}"), m);
                let mut joined = before.clone();
                joined.push(format!("t{trial}-new"));
                let name_of = |ms: &[String]| -> Vec<String> { assignment(p, ms).into_iter().map(|o| ms[o.unwrap()].clone()).collect() };
                let a = name_of(&before);
                let b = name_of(&joined);
                let moved = a.iter().zip(&b).filter(|(x, y)| x != y).count();
                let ideal = (p as usize).div_ceil(m + 1);
                assert!(moved <= 2 * ideal, "P={p} M={m}→{}: {moved} moved, ideal {ideal}", m + 1);
                // Deterministic: the same members give the same answer (a restarted instance
                // with the same name gets its partitions back).
                assert_eq!(name_of(&before), a, "deterministic");
                let left: Vec<String> = before[1..].to_vec();
                let c = name_of(&left);
                let moved = a.iter().zip(&c).filter(|(x, y)| x != y).count();
                let ideal = (p as usize).div_ceil(m);
                assert!(moved <= 2 * ideal, "P={p} M={m}→{}: {moved} moved, ideal {ideal}", m - 1);
            }
        }
    }

    #[test]
    fn desired_partitions_partition_the_space() {
        let members = names("m", 3);
        let mut all = BTreeSet::new();
        for me in &members {
            let d = desired_partitions(24, &members, me);
            assert_eq!(d.len(), 8);
            assert!(all.is_disjoint(&d));
            all.extend(d);
        }
        assert_eq!(all.len(), 24);
        assert!(desired_partitions(24, &members, "stranger").is_empty());
    }
}
