//! What a requester may ask of the daemon (`[requests]`): where its result may go (`reply_to`),
//! which sampling parameters reach the LLM server and how large, which models, how many chat
//! messages.
//!
//! The daemon publishes results with its own broker credentials, so without a rule any requester
//! could make it publish into any queue of the vhost (the input queue, the dead-letter queue,
//! another tenant's reply queue), and ask the LLM server for a million tokens or a thousand
//! choices. [`RequestPolicy::check`] runs on every request at intake
//! ([`crate::publisher::parse_or_dead_letter`]), after the message contract
//! ([`crate::request::parse`]); a request outside the policy is dead-lettered with reason
//! [`REASON_REPLY_TO_NOT_ALLOWED`] or [`REASON_PARAM_NOT_ALLOWED`] and a detail naming the field,
//! and never reaches a partition or the LLM server.
//!
//! `reply_to` rule: empty (results go to `amqp.results_queue`), RabbitMQ's direct reply-to
//! ([`DIRECT_REPLY_TO`], <https://www.rabbitmq.com/docs/direct-reply-to>: the requester consumes
//! the pseudo-queue and needs no reply queue at all), or a name matching
//! `requests.reply_to_pattern`, matched against the whole name (default
//! [`DEFAULT_REPLY_TO_PATTERN`]: server-named queues, as declared by `prefix-batcher submit` and
//! the usual RPC clients). The daemon's own queues (input,
//! partition, results and dead-letter queues) are refused whatever the pattern says.

use std::collections::HashSet;

use regex::Regex;
use serde_json::Value;

use serde::{Deserialize, Serialize};

pub use crate::request::{REASON_PARAM_NOT_ALLOWED, REASON_REPLY_TO_NOT_ALLOWED};
use crate::request::{Body, Request};


/// RabbitMQ's direct reply-to pseudo-queue. A requester publishes with this `reply_to`; the broker
/// rewrites it to `amq.rabbitmq.reply-to.<token>`, the name the result is published to.
pub const DIRECT_REPLY_TO: &str = "amq.rabbitmq.reply-to";

/// Default `requests.reply_to_pattern`: server-named queues (`amq.gen-…`, what a
/// `queue.declare` with an empty name creates; exclusive to the requester's connection). The
/// pattern must match the whole queue name.
pub const DEFAULT_REPLY_TO_PATTERN: &str = r"amq\.gen-.*";

/// Fields of the request body that are not parameters: the LLM call's body takes `model`,
/// `prompt` and `messages` from the request's own fields (`llm::OWN_BODY_KEYS`), so in `params`
/// they would be dropped. Never allowed there, even with `"*"`.
pub const REQUEST_FIELDS: &[&str] = &["model", "prompt", "messages"];

/// Default `requests.allowed_params`: the sampling and output parameters of the OpenAI
/// completions and chat completions APIs, and the common extensions of vLLM, SGLang and
/// llama.cpp's server ([`crate::request::SAMPLING_PARAMS`]). `"*"` in the list allows any parameter.
pub const DEFAULT_ALLOWED_PARAMS: &[&str] = crate::request::SAMPLING_PARAMS;

/// Default cap of `max_tokens` / `max_completion_tokens`.
pub const DEFAULT_MAX_TOKENS: u64 = 32_768;

/// Default cap of `n` and `best_of`.
pub const DEFAULT_MAX_N: u64 = 16;

/// Default cap of `logprobs` (completions: an integer) and `top_logprobs` (chat): vLLM's default
/// `--max-logprobs` is 20 (its engine arguments), and OpenAI's `top_logprobs` is at most 20.
pub const DEFAULT_MAX_LOGPROBS: u64 = 20;

/// Default cap of the number of chat `messages` of one request.
pub const DEFAULT_MAX_MESSAGES: usize = 1_024;

/// `[requests]`: what a requester may ask (see this module).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawRequests {
    /// Regular expression (Rust `regex` syntax) of the queue names results may be published to,
    /// besides RabbitMQ's direct reply-to.
    pub reply_to_pattern: String,
    /// Parameters (keys of a request's `params`) passed to the LLM server; `"*"` allows any.
    pub allowed_params: Vec<String>,
    /// Cap of `max_tokens` and `max_completion_tokens`.
    pub max_tokens: u64,
    /// Cap of `n` and `best_of`.
    pub max_n: u64,
    /// Cap of the integer `logprobs` (completions) and of `top_logprobs` (chat).
    pub max_logprobs: u64,
    /// Models a request may name; empty: any.
    pub models: Vec<String>,
    /// Most chat `messages` in one request.
    pub max_messages: u64,
}

impl Default for RawRequests {
    fn default() -> Self {
        RawRequests {
            reply_to_pattern: DEFAULT_REPLY_TO_PATTERN.into(),
            allowed_params: DEFAULT_ALLOWED_PARAMS.iter().map(|s| (*s).to_owned()).collect(),
            max_tokens: DEFAULT_MAX_TOKENS,
            max_n: DEFAULT_MAX_N,
            max_logprobs: DEFAULT_MAX_LOGPROBS,
            models: Vec::new(),
            max_messages: DEFAULT_MAX_MESSAGES as u64,
        }
    }
}

/// A `[requests]` value that breaks a rule: the key, the value as written, the rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    pub key: &'static str,
    pub value: String,
    pub rule: String,
}

fn invalid(key: &'static str, value: impl std::fmt::Display, rule: impl Into<String>) -> PolicyError {
    PolicyError { key, value: value.to_string(), rule: rule.into() }
}

/// The validated `[requests]` section. Built only by [`RequestPolicy::from_raw`].
#[derive(Debug, Clone)]
pub struct RequestPolicy {
    reply_to: Regex,
    /// Queue names that are never a reply target: the daemon's own.
    own_queues: HashSet<String>,
    /// The partition queues' name prefix (`amqp.partition_queue_prefix` + `.`).
    partition_prefix: String,
    /// `None`: any parameter.
    allowed_params: Option<HashSet<String>>,
    max_tokens: u64,
    max_n: u64,
    max_logprobs: u64,
    /// `None`: any model.
    models: Option<HashSet<String>>,
    max_messages: usize,
}

impl RequestPolicy {
    /// Validates `[requests]`. `own_queues`: the daemon's input, results and dead-letter queues;
    /// `partition_queue_prefix`: `amqp.partition_queue_prefix` (partition queues are
    /// `{prefix}.NNN`). None of them is ever a reply target.
    ///
    /// Errors: `requests.reply_to_pattern` that is not a regular expression (Rust `regex` syntax),
    /// an empty parameter or model name, a cap of 0.
    pub fn from_raw(r: &RawRequests, own_queues: &[&str], partition_queue_prefix: &str) -> Result<Self, PolicyError> {
        let pattern = &r.reply_to_pattern;
        if pattern.trim().is_empty() {
            return Err(invalid("requests.reply_to_pattern", format!("{pattern:?}"), "must not be empty (use \".*\" to allow every queue but the daemon's own)"));
        }
        // Matched against the whole name: `myapp\.replies\..*` must not admit `victim.myapp.replies.x`.
        let reply_to = Regex::new(&format!("^(?:{pattern})$"))
            .map_err(|e| invalid("requests.reply_to_pattern", format!("{pattern:?}"), format!("must be a regular expression: {e}")))?;
        // Names are trimmed (`a, b` in an environment variable means `a` and `b`).
        let names = |key: &'static str, list: &[String]| -> Result<Option<HashSet<String>>, PolicyError> {
            if let Some(bad) = list.iter().find(|p| p.trim().is_empty()) {
                return Err(invalid(key, format!("{bad:?}"), "names must not be empty"));
            }
            Ok((!list.iter().any(|p| p.trim() == "*")).then(|| list.iter().map(|p| p.trim().to_owned()).collect()))
        };
        let allowed_params = names("requests.allowed_params", &r.allowed_params)?;
        if let Some(own) = r.allowed_params.iter().find(|p| REQUEST_FIELDS.contains(&p.trim())) {
            return Err(invalid(
                "requests.allowed_params",
                format!("{own:?}"),
                "must not name a field of the request itself (model, prompt, messages): the LLM call's body takes them from the request's own fields, so such a parameter would be dropped",
            ));
        }
        let models = if r.models.is_empty() { None } else { names("requests.models", &r.models)? };
        let cap = |key: &'static str, v: u64| if v == 0 { Err(invalid(key, v, "must be at least 1")) } else { Ok(v) };
        Ok(RequestPolicy {
            reply_to,
            own_queues: own_queues.iter().map(|q| (*q).to_owned()).collect(),
            partition_prefix: format!("{partition_queue_prefix}."),
            allowed_params,
            max_tokens: cap("requests.max_tokens", r.max_tokens)?,
            max_n: cap("requests.max_n", r.max_n)?,
            max_logprobs: cap("requests.max_logprobs", r.max_logprobs)?,
            models,
            max_messages: usize::try_from(cap("requests.max_messages", r.max_messages)?).unwrap_or(usize::MAX),
        })
    }

    /// A hash of every rule here (the same for equal `[requests]` sections, whatever the order of
    /// their lists): members of one deployment compare theirs, since a request another member
    /// would answer must not be dead-lettered by this one.
    pub fn fingerprint(&self) -> u64 {
        let sorted = |set: &Option<HashSet<String>>| -> String {
            set.as_ref().map_or_else(|| "*".to_owned(), |s| {
                let mut v: Vec<&str> = s.iter().map(String::as_str).collect();
                v.sort_unstable();
                format!("{v:?}")
            })
        };
        let text = format!(
            "reply_to={} params={} models={} max_tokens={} max_n={} max_logprobs={} max_messages={}",
            self.reply_to.as_str(),
            sorted(&self.allowed_params),
            sorted(&self.models),
            self.max_tokens,
            self.max_n,
            self.max_logprobs,
            self.max_messages
        );
        xxhash_rust::xxh3::xxh3_64(text.as_bytes())
    }

    /// Checks a parsed request and its `reply_to` property. `Err((reason, detail))`: the
    /// dead-letter reason ([`REASON_REPLY_TO_NOT_ALLOWED`] or [`REASON_PARAM_NOT_ALLOWED`]) and a
    /// detail naming the field, the value (cut to 100 characters) and the rule.
    pub fn check(&self, req: &Request, reply_to: Option<&str>) -> Result<(), (&'static str, String)> {
        self.check_reply_to(reply_to.unwrap_or_default()).map_err(|d| (REASON_REPLY_TO_NOT_ALLOWED, d))?;
        self.check_params(req).map_err(|d| (REASON_PARAM_NOT_ALLOWED, d))
    }

    /// Whether results may be published to `reply_to` (see the module documentation).
    pub fn check_reply_to(&self, reply_to: &str) -> Result<(), String> {
        if reply_to.is_empty() {
            return Ok(());
        }
        let own = self.own_queues.contains(reply_to) || reply_to.starts_with(&self.partition_prefix);
        if own {
            return Err(format!("reply_to {:?} is one of the daemon's own queues", cut(reply_to)));
        }
        let direct = reply_to == DIRECT_REPLY_TO || reply_to.strip_prefix(DIRECT_REPLY_TO).is_some_and(|t| t.starts_with('.'));
        if direct || self.reply_to.is_match(reply_to) {
            return Ok(());
        }
        Err(format!("reply_to {:?} matches neither {DIRECT_REPLY_TO} nor requests.reply_to_pattern", cut(reply_to)))
    }

    fn check_params(&self, req: &Request) -> Result<(), String> {
        if let (Some(models), Some(model)) = (&self.models, &req.model) {
            if !models.contains(model) {
                return Err(format!("model {:?} is not in requests.models", cut(model)));
            }
        }
        if let Body::Chat(msgs) = &req.body {
            if msgs.len() > self.max_messages {
                return Err(format!("{} messages, more than requests.max_messages = {}", msgs.len(), self.max_messages));
            }
        }
        for (name, value) in &req.params {
            if REQUEST_FIELDS.contains(&name.as_str()) {
                return Err(format!(
                    "parameter {name:?} is a field of the request itself, not a sampling parameter (it would be dropped): put it at the top level of the body"
                ));
            }
            if self.allowed_params.as_ref().is_some_and(|a| !a.contains(name)) {
                return Err(format!("parameter {:?} is not in requests.allowed_params", cut(name)));
            }
            // (cap key, least value, cap): `n` and `best_of` count choices, at least one (OpenAI API).
            let cap = match name.as_str() {
                "max_tokens" | "max_completion_tokens" => Some(("requests.max_tokens", 0, self.max_tokens)),
                "n" | "best_of" => Some(("requests.max_n", 1, self.max_n)),
                "top_logprobs" => Some(("requests.max_logprobs", 0, self.max_logprobs)),
                // Completions: an integer; chat: a boolean (its count is `top_logprobs`).
                "logprobs" if !value.is_boolean() => Some(("requests.max_logprobs", 0, self.max_logprobs)),
                _ => None,
            };
            let Some((key, min, max)) = cap else { continue };
            match value {
                Value::Null => {}
                Value::Number(n) if n.as_u64().is_some_and(|v| (min..=max).contains(&v)) => {}
                _ => return Err(format!("parameter {name:?} = {} must be an integer from {min} to {key} = {max}", cut(&value.to_string()))),
            }
        }
        Ok(())
    }
}

/// At most 100 characters of `s`, for error details.
fn cut(s: &str) -> String {
    let mut out: String = s.chars().take(100).collect();
    if out.len() < s.len() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Map};

    use super::*;

    const OWN: [&str; 3] = ["prompts", "results", "dead-letters"];
    const PARTITIONS: &str = "prompts.partition";

    fn policy(edit: impl FnOnce(&mut RawRequests)) -> RequestPolicy {
        let mut raw = RawRequests::default();
        edit(&mut raw);
        RequestPolicy::from_raw(&raw, &OWN, PARTITIONS).expect("valid")
    }

    fn completion(params: Value) -> Request {
        let Value::Object(params) = params else { panic!("params must be an object") };
        Request { id: "r".into(), body: Body::Completion("hi".into()), model: None, params, prefix_key: None }
    }

    #[test]
    fn reply_to_allows_direct_reply_to_server_named_queues_and_the_pattern_only() {
        let p = policy(|_| {});
        for ok in ["", "amq.rabbitmq.reply-to", "amq.rabbitmq.reply-to.g1h2AA==.abc", "amq.gen-Xa2_9"] {
            assert!(p.check_reply_to(ok).is_ok(), "{ok} should be allowed");
        }
        for bad in ["other-tenant.replies", "amq.rabbitmq.reply-tox", "gen-amq.gen-x"] {
            let e = p.check_reply_to(bad).unwrap_err();
            assert!(e.contains("requests.reply_to_pattern"), "{e}");
        }
        let p = policy(|r| r.reply_to_pattern = r"tenant-a\..*".into());
        assert!(p.check_reply_to("tenant-a.replies").is_ok());
        assert!(p.check_reply_to("tenant-b.replies").is_err());
        assert!(p.check_reply_to("x.tenant-a.replies").is_err(), "the pattern matches the whole name");
    }

    #[test]
    fn the_daemons_own_queues_are_never_a_reply_target() {
        let p = policy(|r| r.reply_to_pattern = ".*".into());
        let own = OWN.iter().map(|q| (*q).to_owned()).chain([format!("{PARTITIONS}.003")]);
        for q in own {
            let e = p.check_reply_to(&q).unwrap_err();
            assert!(e.contains("own queues"), "{q}: {e}");
        }
        assert!(p.check_reply_to("anything.else").is_ok());
    }

    #[test]
    fn params_outside_the_allowlist_or_over_a_cap_are_refused_naming_the_parameter() {
        let p = policy(|_| {});
        assert!(p.check(&completion(json!({"max_tokens": 32768, "temperature": 0.2, "n": 16, "logprobs": 20})), None).is_ok());
        let cases = [
            (json!({"max_tokens": 32769}), "max_tokens"),
            (json!({"max_completion_tokens": 1_000_000}), "max_completion_tokens"),
            (json!({"max_tokens": "lots"}), "max_tokens"),
            (json!({"max_tokens": -1}), "max_tokens"),
            (json!({"n": 17}), "\"n\""),
            (json!({"n": 0}), "from 1 to requests.max_n"),
            (json!({"best_of": 100}), "best_of"),
            (json!({"logprobs": 21}), "logprobs"),
            (json!({"top_logprobs": 50}), "top_logprobs"),
            (json!({"guided_grammar": "x"}), "guided_grammar"),
        ];
        for (params, named) in cases {
            let (reason, detail) = p.check(&completion(params.clone()), None).unwrap_err();
            assert_eq!(reason, REASON_PARAM_NOT_ALLOWED, "{params}");
            assert!(detail.contains(named), "{params}: {detail}");
        }
        // Chat's boolean `logprobs` is not a count.
        assert!(p.check(&completion(json!({"logprobs": true, "top_logprobs": 5})), None).is_ok());
        let any = policy(|r| r.allowed_params = vec!["*".into()]);
        assert!(any.check(&completion(json!({"guided_grammar": "x"})), None).is_ok());
        assert!(any.check(&completion(json!({"max_tokens": 40000})), None).is_err(), "caps hold with any parameter allowed");
        for own in ["model", "prompt", "messages"] {
            let err = any.check(&completion(json!({own: "x"})), None).unwrap_err().1;
            assert!(err.contains("field of the request itself"), "{own}: {err}");
        }
    }

    #[test]
    fn models_and_message_counts_are_limited_when_configured() {
        let p = policy(|r| (r.models, r.max_messages) = (vec!["small".into()], 2));
        let mut req = completion(json!({}));
        assert!(p.check(&req, None).is_ok(), "no model: the configured one");
        req.model = Some("small".into());
        assert!(p.check(&req, None).is_ok());
        req.model = Some("huge".into());
        assert!(p.check(&req, None).unwrap_err().1.contains("requests.models"));
        let msg = |t: &str| crate::request::ChatMessage { role: "user".into(), text: t.into(), raw: json!({"role": "user", "content": t}) };
        let chat = Request { body: Body::Chat(vec![msg("a"), msg("b"), msg("c")]), model: None, params: Map::new(), ..completion(json!({})) };
        assert!(p.check(&chat, None).unwrap_err().1.contains("requests.max_messages"));
    }

    #[test]
    fn a_bad_policy_names_the_key() {
        let err = |raw: RawRequests| RequestPolicy::from_raw(&raw, &OWN, PARTITIONS).unwrap_err().key;
        assert_eq!(err(RawRequests { reply_to_pattern: "(".into(), ..RawRequests::default() }), "requests.reply_to_pattern");
        assert_eq!(err(RawRequests { max_tokens: 0, ..RawRequests::default() }), "requests.max_tokens");
        assert_eq!(err(RawRequests { allowed_params: vec![" ".into()], ..RawRequests::default() }), "requests.allowed_params");
        assert_eq!(err(RawRequests { reply_to_pattern: "".into(), ..RawRequests::default() }), "requests.reply_to_pattern");
        // Observed: listed, `params: {"model": "evil-model"}` was answered with the configured
        // model, the parameter dropped silently.
        for own in ["model", " prompt", "messages"] {
            assert_eq!(err(RawRequests { allowed_params: vec!["max_tokens".into(), own.into()], ..RawRequests::default() }), "requests.allowed_params", "{own}");
        }
        let spaced = RequestPolicy::from_raw(&RawRequests { allowed_params: vec!["max_tokens".into(), " temperature".into()], ..RawRequests::default() }, &OWN, PARTITIONS).unwrap();
        assert!(spaced.check(&completion(json!({"temperature": 0})), None).is_ok(), "names are trimmed");
    }
}
