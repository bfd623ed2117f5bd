//! Workloads from the shared data directory (never copied into the repository): samples of the
//! four text datasets, the Mooncake trace rendered as text, and the hot-prefix workload.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use anyhow::{bail, Context};
use serde_json::{json, Value};

/// bbh-cot: one header per task (tasks that share a header are one prefix group).
const BBH_HEADERS: &str = "bbh-cot/headers.jsonl";
/// bbh-cot: the prompts (header + question).
const BBH_PROMPTS: &str = "bbh-cot/bbh_cot_prompts.jsonl.gz";
const MMLU_PROMPTS: &str = "mmlu-5shot/mmlu_5shot_test_prompts.jsonl.gz";
/// bfcl-multiturn: each conversation's first request (its long tool-schema system prompt first).
pub(crate) const BFCL_FIRST_REQUESTS: &str = "bfcl-multiturn/bfcl_multi_turn_first_requests.jsonl.gz";
const ORCA_PAIRS: &str = "orca-dpo-sample/orca_dpo_pairs_validation.jsonl";
const MOONCAKE_TRACE: &str = "mooncake/conversation_trace.jsonl";

/// The datasets of the shared data directory and the files the runner reads of each (paths
/// relative to the data directory).
pub const DATASET_FILES: &[(&str, &[&str])] = &[
    ("bbh-cot", &[BBH_HEADERS, BBH_PROMPTS]),
    ("mmlu-5shot", &[MMLU_PROMPTS]),
    ("bfcl-multiturn", &[BFCL_FIRST_REQUESTS]),
    ("orca-dpo-sample", &[ORCA_PAIRS]),
    ("mooncake", &[MOONCAKE_TRACE]),
];

/// The datasets `part` reads; `cache_datasets` are part 1's (the plan's, which depend on the
/// mode and `BENCH_DATASETS`). Unknown parts read nothing (the arguments are checked first).
pub fn datasets_of_part(part: &str, cache_datasets: &[String]) -> Vec<String> {
    let fixed: &[&str] = match part {
        "cache" => return cache_datasets.to_vec(),
        "scale" => &["mooncake"],
        // Overhead samples bbh-cot; hot and shift build their workload from its prompts.
        "overhead" | "hot" | "shift" => &["bbh-cot"],
        // The Mooncake trace rendered as chat, and bfcl-multiturn conversations.
        "chat" => &["mooncake", "bfcl-multiturn"],
        "peers" => &["mooncake", "bfcl-multiturn", "bbh-cot"],
        "peers-llama" => crate::peers::LLAMA_DATASETS,
        _ => &[],
    };
    fixed.iter().map(|d| (*d).to_owned()).collect()
}

/// Checks that `dir` holds every file the `parts` read (`cache_datasets`: part 1's datasets).
/// Errors: the directory is missing; a dataset is unknown; files are missing (each named with
/// its dataset and the parts that need it).
pub fn check_data(dir: &Path, parts: &[&str], cache_datasets: &[String]) -> anyhow::Result<()> {
    if !dir.is_dir() {
        bail!(
            "data directory {} does not exist: pass --data DIR or set PREFIX_BATCHER_DATA (the default is ../shared/data next to the repository)",
            dir.display()
        );
    }
    // (dataset, parts that read it), in the order of the parts.
    let mut needed: Vec<(String, Vec<&str>)> = Vec::new();
    for part in parts {
        for ds in datasets_of_part(part, cache_datasets) {
            match needed.iter_mut().find(|(d, _)| *d == ds) {
                Some((_, ps)) => ps.push(part),
                None => needed.push((ds, vec![part])),
            }
        }
    }
    let mut missing = Vec::new();
    for (ds, ps) in &needed {
        let Some((_, files)) = DATASET_FILES.iter().find(|(d, _)| d == ds) else {
            let known: Vec<&str> = DATASET_FILES.iter().map(|(d, _)| *d).collect();
            bail!("unknown dataset {ds} (for {}; BENCH_DATASETS?): the datasets are {}", ps.join(", "), known.join(", "));
        };
        for f in files.iter().map(|f| dir.join(f)).filter(|f| !f.is_file()) {
            missing.push(format!("{} (dataset {ds}, read by {})", f.display(), ps.join(", ")));
        }
    }
    if !missing.is_empty() {
        bail!("missing data in {}: {}; pass --data DIR or set PREFIX_BATCHER_DATA", dir.display(), missing.join("; "));
    }
    Ok(())
}

fn open_lines(path: &Path) -> anyhow::Result<Box<dyn BufRead>> {
    let f = std::fs::File::open(path).with_context(|| format!("{} not found: pass --data DIR pointing at the shared data directory", path.display()))?;
    let r: Box<dyn Read> = if path.extension().is_some_and(|e| e == "gz") { Box::new(flate2::read::GzDecoder::new(f)) } else { Box::new(f) };
    Ok(Box::new(BufReader::new(r)))
}

pub fn read_jsonl(path: &Path) -> anyhow::Result<Vec<Value>> {
    let mut out = Vec::new();
    for line in open_lines(path)?.lines() {
        let line = line?;
        if !line.trim().is_empty() {
            out.push(serde_json::from_str(&line)?);
        }
    }
    Ok(out)
}

/// One request of a text dataset, ready to publish.
#[derive(Debug, Clone)]
pub struct Item {
    pub id: String,
    /// The request body (JSON).
    pub body: Value,
    /// The group (task, subject, class set…) whose shared prefix the item carries.
    pub group: String,
}

/// How a dataset sample was drawn, for the report.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SampleInfo {
    pub dataset: String,
    pub requests: usize,
    pub groups: usize,
    pub note: String,
}

/// Sizes of the samples.
#[derive(Debug, Clone, Copy)]
pub struct SampleSize {
    pub groups: usize,
    pub per_group: usize,
    pub max_tokens: u64,
    /// bfcl: system prompts are cut to this many characters.
    pub bfcl_system_chars: usize,
    /// orca: requests are sampled among those whose text is at most this long.
    pub orca_max_chars: usize,
    /// mmlu: prompts longer than this are skipped (llama-server's 4096-token slot context).
    pub mmlu_max_chars: usize,
}

fn params(max_tokens: u64) -> Value {
    json!({"max_tokens": max_tokens, "temperature": 0})
}

/// Picks `groups` groups (with at least `per_group` members) and `per_group` items of each, then
/// shuffles everything: a random mix, as many publishers would send it.
fn pick(mut by_group: BTreeMap<String, Vec<Item>>, groups: usize, per_group: usize, rng: &mut fastrand::Rng) -> Vec<Item> {
    by_group.retain(|_, v| v.len() >= per_group);
    let mut names: Vec<String> = by_group.keys().cloned().collect();
    rng.shuffle(&mut names);
    let mut out = Vec::new();
    for g in names.into_iter().take(groups) {
        let mut v = by_group.remove(&g).unwrap();
        rng.shuffle(&mut v);
        out.extend(v.into_iter().take(per_group));
    }
    rng.shuffle(&mut out);
    out
}

/// A seeded sample of `dataset`. Longer than 80 lines on purpose: one `match` arm per dataset
/// format, each short, kept side by side so the formats can be compared.
pub fn sample(data: &Path, dataset: &str, n: SampleSize, seed: u64) -> anyhow::Result<(Vec<Item>, SampleInfo)> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut by_group: BTreeMap<String, Vec<Item>> = BTreeMap::new();
    let (items, note) = match dataset {
        "bbh-cot" => {
            // Tasks that share one header (logical_deduction_*, tracking_shuffled_objects_*) are one group.
            let headers: Vec<Value> = read_jsonl(&data.join(BBH_HEADERS))?;
            let header_of: BTreeMap<String, String> =
                headers.iter().map(|h| (h["task"].as_str().unwrap_or("").to_owned(), h["header"].as_str().unwrap_or("").to_owned())).collect();
            for r in read_jsonl(&data.join(BBH_PROMPTS))? {
                let task = r["task"].as_str().unwrap_or("").to_owned();
                let group = header_of.get(&task).map(|h| format!("{:016x}", prefix_batcher::keying::PrefixKey::of(h).0)).unwrap_or(task.clone());
                by_group.entry(group.clone()).or_default().push(Item {
                    id: format!("bbh-{task}-{}", r["idx"]),
                    body: json!({"prompt": r["prompt"], "params": params(n.max_tokens)}),
                    group,
                });
            }
            (pick(by_group, n.groups, n.per_group, &mut rng), format!("{} header groups × {} prompts, random order", n.groups, n.per_group))
        }
        "mmlu-5shot" => {
            for r in read_jsonl(&data.join(MMLU_PROMPTS))? {
                let prompt = r["prompt"].as_str().unwrap_or("");
                if prompt.chars().count() > n.mmlu_max_chars {
                    continue;
                }
                let subject = r["subject"].as_str().unwrap_or("").to_owned();
                by_group.entry(subject.clone()).or_default().push(Item {
                    id: format!("mmlu-{subject}-{}", r["idx"]),
                    body: json!({"prompt": prompt, "params": params(n.max_tokens)}),
                    group: subject,
                });
            }
            (
                pick(by_group, n.groups, n.per_group, &mut rng),
                format!("{} subjects × {} prompts (prompts ≤ {} chars), random order", n.groups, n.per_group, n.mmlu_max_chars),
            )
        }
        "bfcl-multiturn" => {
            for r in read_jsonl(&data.join(BFCL_FIRST_REQUESTS))? {
                let mut msgs = r["first_turn_messages"].as_array().cloned().unwrap_or_default();
                let mut group = String::new();
                for m in msgs.iter_mut() {
                    if m["role"] == "system" {
                        let full = m["content"].as_str().unwrap_or("");
                        let cut: String = full.chars().take(n.bfcl_system_chars).collect();
                        group = format!("{:016x}", prefix_batcher::keying::PrefixKey::of(&cut).0);
                        m["content"] = Value::String(cut);
                    }
                }
                by_group.entry(group.clone()).or_default().push(Item {
                    id: format!("bfcl-{}", r["id"].as_str().unwrap_or("")),
                    body: json!({"messages": msgs, "params": params(n.max_tokens)}),
                    group,
                });
            }
            (
                pick(by_group, n.groups, n.per_group, &mut rng),
                format!(
                    "{} distinct system prompts × {} requests; system prompts cut to their first {} chars (the model's slot context is 4096 tokens; full ones are ~9k tokens)",
                    n.groups, n.per_group, n.bfcl_system_chars
                ),
            )
        }
        "orca-dpo-sample" => {
            let mut all = Vec::new();
            for (i, r) in read_jsonl(&data.join(ORCA_PAIRS))?.into_iter().enumerate() {
                let msgs = r["input"]["messages"].clone();
                let chars: usize = msgs.as_array().map(|a| a.iter().map(|m| m["content"].as_str().map_or(0, |s| s.chars().count())).sum()).unwrap_or(0);
                if chars > n.orca_max_chars {
                    continue;
                }
                let system = msgs[0]["content"].as_str().unwrap_or("").to_owned();
                all.push(Item { id: format!("orca-{i}"), body: json!({"messages": msgs, "params": params(n.max_tokens)}), group: system });
            }
            rng.shuffle(&mut all);
            let k = n.groups * n.per_group;
            all.truncate(k);
            (all, format!("{k} random requests with ≤ {} chars of text (one shared system prompt)", n.orca_max_chars))
        }
        other => bail!("unknown dataset {other}"),
    };
    let groups = items.iter().map(|i| i.group.as_str()).collect::<std::collections::BTreeSet<_>>().len();
    let info = SampleInfo { dataset: dataset.to_owned(), requests: items.len(), groups, note };
    Ok((items, info))
}

// ---------------------------------------------------------------------------------------------
// Mooncake
// ---------------------------------------------------------------------------------------------

/// One Mooncake trace request.
#[derive(Debug, Clone)]
pub struct TraceReq {
    pub timestamp_ms: u64,
    pub input_length: u64,
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
}

pub fn read_mooncake(data: &Path) -> anyhow::Result<Vec<TraceReq>> {
    let rows = read_jsonl(&data.join(MOONCAKE_TRACE))?;
    Ok(rows
        .into_iter()
        .map(|r| TraceReq {
            timestamp_ms: r["timestamp"].as_u64().unwrap_or(0),
            input_length: r["input_length"].as_u64().unwrap_or(0),
            output_length: r["output_length"].as_u64().unwrap_or(0),
            hash_ids: r["hash_ids"].as_array().map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default(),
        })
        .collect())
}

/// Tokens per Mooncake hash block.
pub const TRACE_BLOCK_TOKENS: u64 = 512;

/// Block-level hit ratio of an infinite shared cache (each block a hit when any earlier request
/// had it) — the trace's oracle.
pub fn trace_oracle(reqs: &[TraceReq]) -> f64 {
    let mut seen = std::collections::HashSet::new();
    let (mut hits, mut total) = (0u64, 0u64);
    for r in reqs {
        for &h in &r.hash_ids {
            total += 1;
            if !seen.insert(h) {
                hits += 1;
            }
        }
    }
    hits as f64 / total.max(1) as f64
}

/// Keeps whole conversations: the requests whose second block id (the first is shared by all)
/// falls in `1/keep_one_in` of the id space. Requests with one block are kept by their first.
pub fn thin_conversations(reqs: &[TraceReq], keep_one_in: u64) -> Vec<TraceReq> {
    if keep_one_in <= 1 {
        return reqs.to_vec();
    }
    reqs.iter()
        .filter(|r| {
            let id = r.hash_ids.get(1).or(r.hash_ids.first()).copied().unwrap_or(0);
            xxhash_mix(id).is_multiple_of(keep_one_in)
        })
        .cloned()
        .collect()
}

fn xxhash_mix(x: u64) -> u64 {
    // splitmix64 finaliser: a fixed, well-spread hash of the id.
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he", "this", "are", "or",
    "his", "from", "at", "which", "but", "have", "an", "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has",
    "there", "been", "if", "more", "when", "will", "would", "who", "so", "no", "model", "cache", "token", "block", "prefix", "server",
];

/// The deterministic text of Mooncake block `id`: `chars` characters of words drawn from a
/// generator seeded by the id, so the same id always renders the same text and different ids
/// (almost surely) differ in their first characters.
pub fn block_text(id: u64, chars: usize) -> String {
    let mut rng = fastrand::Rng::with_seed(xxhash_mix(id ^ 0x6d6f_6f6e));
    let mut s = format!("[{id:x}] ");
    while s.len() < chars {
        s.push_str(WORDS[rng.usize(..WORDS.len())]);
        s.push(' ');
    }
    s.truncate(chars);
    s
}

/// Renders a trace request as a prompt of `input_length × chars_per_token` characters: its
/// blocks' texts in order (the last block cut to the remaining length).
pub fn render_trace(r: &TraceReq, chars_per_token: usize, cache: &mut std::collections::HashMap<u64, String>) -> String {
    let block_chars = (TRACE_BLOCK_TOKENS as usize) * chars_per_token;
    let total = (r.input_length as usize).min(r.hash_ids.len() * TRACE_BLOCK_TOKENS as usize) * chars_per_token;
    let mut s = String::with_capacity(total);
    for &h in &r.hash_ids {
        let t = cache.entry(h).or_insert_with(|| block_text(h, block_chars));
        let take = (total - s.len()).min(block_chars);
        s.push_str(&t[..take]);
        if s.len() >= total {
            break;
        }
    }
    s
}

/// The hot-prefix workload: a share `hot` of the requests carry one BIG-Bench-Hard header, the
/// rest one of `cold` other headers; each gets a real question from its task.
pub fn hot_prefix_prompts(data: &Path, cold: usize, seed: u64) -> anyhow::Result<(Vec<String>, Vec<Vec<String>>)> {
    let mut by_task: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for r in read_jsonl(&data.join(BBH_PROMPTS))? {
        by_task.entry(r["task"].as_str().unwrap_or("").to_owned()).or_default().push(r["prompt"].as_str().unwrap_or("").to_owned());
    }
    // One task per header: drop the tasks that share a header with an earlier one.
    let mut seen = std::collections::HashSet::new();
    let mut tasks: Vec<Vec<String>> = Vec::new();
    for (_, prompts) in by_task {
        let head: String = prompts[0].chars().take(200).collect();
        if seen.insert(head) {
            tasks.push(prompts);
        }
    }
    let mut rng = fastrand::Rng::with_seed(seed);
    rng.shuffle(&mut tasks);
    let hot = tasks.remove(0);
    tasks.truncate(cold);
    Ok((hot, tasks))
}
