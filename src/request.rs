//! The message contract: parsing prompt requests and shaping results.
//!
//! A request is an AMQP message whose body is a UTF-8 JSON object with exactly one of `prompt`
//! (completions style) or `messages` (OpenAI chat style). Anything that cannot be parsed into a
//! [`Request`] yields a [`ParseError`] whose [`ParseError::reason`] is the stable, machine-readable
//! value of the `x-death-reason` header on the dead-lettered message.

use lapin::types::ShortString;
use serde::Serialize;
use serde_json::{Map, Value};

/// Roles accepted in chat messages (OpenAI chat completions API, including `developer`).
pub const CHAT_ROLES: &[&str] = &["system", "user", "assistant", "tool", "developer"];

/// A parsed prompt request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Request id: the body's `id`, else the AMQP `message_id`, else a generated UUID v4.
    pub id: String,
    /// The prompt itself.
    pub body: Body,
    /// Overrides the configured model when set.
    pub model: Option<String>,
    /// OpenAI sampling parameters passed through untouched (`max_tokens`, `temperature`, …,
    /// and server-specific ones such as llama.cpp's `cache_prompt`).
    pub params: Map<String, Value>,
    /// Explicit prefix key from the body's `prefix_key` or the `x-prefix-key` header; wins over
    /// derivation.
    pub prefix_key: Option<String>,
}

/// The prompt of a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Body {
    /// Completions style: one prompt string.
    Completion(String),
    /// Chat style: validated OpenAI chat messages, kept as JSON so they reach the server unchanged.
    Chat(Vec<ChatMessage>),
}

/// One validated chat message.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatMessage {
    /// One of [`CHAT_ROLES`].
    pub role: String,
    /// The text of the message: the string content, or the `text` parts joined with no separator.
    pub text: String,
    /// The message exactly as received, sent to the server as is.
    pub raw: Value,
}

impl Body {
    /// Number of characters (Unicode scalar values) of prompt text, used for batch statistics.
    pub fn text_for_stats(&self) -> std::borrow::Cow<'_, str> {
        match self {
            Body::Completion(p) => std::borrow::Cow::Borrowed(p.as_str()),
            Body::Chat(msgs) => std::borrow::Cow::Owned(render_chat(msgs, usize::MAX)),
        }
    }
}

/// Renders a conversation as role-tagged text (`<|role|>\ntext\n` per message), truncated to at
/// most `max_chars` Unicode scalar values. Used by the `rendered` chat key and by batch statistics.
pub fn render_chat(msgs: &[ChatMessage], max_chars: usize) -> String {
    let mut out = String::new();
    let mut n = 0usize;
    for m in msgs {
        for part in ["<|", m.role.as_str(), "|>\n", m.text.as_str(), "\n"] {
            for c in part.chars() {
                if n == max_chars {
                    return out;
                }
                out.push(c);
                n += 1;
            }
        }
    }
    out
}

/// Why a message could not be parsed. The variant decides the `x-death-reason` header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Body larger than `amqp.max_message_bytes`.
    #[error("body is {size} bytes, more than the limit of {limit} bytes")]
    TooLarge { size: usize, limit: usize },
    /// Body is not UTF-8.
    #[error("body is not valid UTF-8: {0}")]
    InvalidUtf8(String),
    /// Body is not JSON, or not a JSON object.
    #[error("body is not a JSON object (invalid JSON, or JSON of another type): {0}")]
    InvalidJson(String),
    /// Neither `prompt` nor `messages`.
    #[error("request has neither `prompt` nor `messages`")]
    MissingPrompt,
    /// `messages` is an empty list (reason `missing_prompt`, as there is no prompt).
    #[error("`messages` is an empty list: a chat request needs at least one message")]
    EmptyMessages,
    /// Both `prompt` and `messages`.
    #[error("request has both `prompt` and `messages`; send exactly one")]
    BothPromptAndMessages,
    /// `messages` is not a list of known OpenAI chat messages.
    #[error("unknown message schema: {0}")]
    UnknownMessageSchema(String),
    /// A field has the wrong type (e.g. `prompt` is a number).
    #[error("invalid field `{field}`: {detail}")]
    InvalidField { field: &'static str, detail: String },
}

impl ParseError {
    /// The stable machine-readable reason, the value of the `x-death-reason` header and of the
    /// `reason` label of `prefix_batcher_dead_letters_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            ParseError::TooLarge { .. } => "too_large",
            ParseError::InvalidUtf8(_) => "invalid_utf8",
            ParseError::InvalidJson(_) => "invalid_json",
            ParseError::MissingPrompt | ParseError::EmptyMessages => "missing_prompt",
            ParseError::BothPromptAndMessages => "both_prompt_and_messages",
            ParseError::UnknownMessageSchema(_) => "unknown_message_schema",
            ParseError::InvalidField { .. } => "invalid_field",
        }
    }
}

/// Dead-letter reason of a request whose `reply_to` the requests policy refuses
/// ([`crate::policy`]).
pub const REASON_REPLY_TO_NOT_ALLOWED: &str = "reply_to_not_allowed";

/// Dead-letter reason of a request with a parameter, model or message count outside the requests
/// policy ([`crate::policy`]).
pub const REASON_PARAM_NOT_ALLOWED: &str = "param_not_allowed";

/// Dead-letter reason of a request delivered `amqp.delivery_limit` times or more without an
/// outcome (see [`crate::redelivery`]).
pub const REASON_DELIVERY_LIMIT: &str = "delivery_limit";

/// Every dead-letter reason: each value [`ParseError::reason`] can return, the policy's
/// ([`crate::policy`]) and [`REASON_DELIVERY_LIMIT`]. For metric initialisation and docs.
pub const DEAD_LETTER_REASONS: &[&str] = &[
    "too_large",
    "invalid_utf8",
    "invalid_json",
    "missing_prompt",
    "both_prompt_and_messages",
    "unknown_message_schema",
    "invalid_field",
    REASON_REPLY_TO_NOT_ALLOWED,
    REASON_PARAM_NOT_ALLOWED,
    REASON_DELIVERY_LIMIT,
];

/// Longest AMQP short string, in bytes: AMQP 0-9-1 specification, section 4.2.5.3 "Strings"
/// ("short strings … can carry up to 255 octets of UTF-8 data";
/// <https://www.rabbitmq.com/resources/specs/amqp0-9-1.pdf>). `message_id`, `correlation_id`,
/// `reply_to`, queue names and header names are short strings.
pub const MAX_SHORT_STRING_BYTES: usize = 255;

/// Longest accepted request id and `correlation_id`, in bytes. Below [`MAX_SHORT_STRING_BYTES`]
/// so that ids derived from it (`{id}:result` and the like, ≤ 55 bytes added) are short strings
/// too.
pub const MAX_ID_BYTES: usize = 200;

/// `value` as an AMQP short string, or [`ParseError::InvalidField`] naming `field` when it is
/// longer than `limit` bytes (or than [`MAX_SHORT_STRING_BYTES`]). Every short string built from
/// outside input goes through here: lapin's `From<&str>` for `ShortString` panics on more than
/// 255 bytes.
pub fn short_string(field: &'static str, value: &str, limit: usize) -> Result<ShortString, ParseError> {
    check_length(field, value, limit)?;
    ShortString::try_new(value).map_err(|e| ParseError::InvalidField { field, detail: e.to_string() })
}

/// Errors with [`ParseError::InvalidField`] when `value` is longer than `limit` bytes.
fn check_length(field: &'static str, value: &str, limit: usize) -> Result<(), ParseError> {
    if value.len() <= limit {
        return Ok(());
    }
    Err(ParseError::InvalidField {
        field,
        detail: format!(
            "is {} bytes, more than the limit of {limit} bytes (AMQP short strings hold at most {MAX_SHORT_STRING_BYTES})",
            value.len()
        ),
    })
}

/// AMQP metadata the parser uses; kept separate from lapin types so parsing stays pure.
#[derive(Debug, Default, Clone)]
pub struct Envelope<'a> {
    /// AMQP `message_id` property.
    pub message_id: Option<&'a str>,
    /// AMQP header `x-prefix-key`.
    pub prefix_key_header: Option<&'a str>,
    /// Set when the `x-prefix-key` header has a type that is not a string: what it is (`"an
    /// integer"`, …). A request that would take its key from it is refused.
    pub prefix_key_header_refused: Option<&'static str>,
    /// AMQP `correlation_id` property (at most [`MAX_ID_BYTES`]).
    pub correlation_id: Option<&'a str>,
    /// AMQP `reply_to` property (at most [`MAX_SHORT_STRING_BYTES`]).
    pub reply_to: Option<&'a str>,
}

/// A JSON value like [`serde_json::Value`], except that an object with a key twice is an error
/// (`duplicate key "id" at line 1 column 17`) instead of keeping the last one silently: which
/// `id`, `prompt` or `max_tokens` a requester meant cannot be known. RFC 8259 §4 leaves such
/// objects to the implementation ("the names within an object SHOULD be unique").
struct StrictJson(Value);

/// Longest part of a duplicate key quoted in the error, in characters.
const DUPLICATE_KEY_SHOWN: usize = 64;

impl<'de> serde::Deserialize<'de> for StrictJson {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(StrictJson)
    }
}

struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(StrictJson(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut obj = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            match obj.entry(key) {
                serde_json::map::Entry::Vacant(slot) => {
                    let StrictJson(v) = map.next_value()?;
                    slot.insert(v);
                }
                serde_json::map::Entry::Occupied(taken) => {
                    let key = taken.key();
                    let shown: String = key.chars().take(DUPLICATE_KEY_SHOWN).collect();
                    let more = if shown.len() < key.len() { "…" } else { "" };
                    return Err(serde::de::Error::custom(format_args!("duplicate key {shown:?}{more}")));
                }
            }
        }
        Ok(Value::Object(obj))
    }
}

/// The sampling and output parameters of the OpenAI completions and chat completions APIs, and
/// the common extensions of vLLM, SGLang and llama.cpp's server: they go in `params`; at the top
/// level of a body [`parse`] refuses them. The default `requests.allowed_params`.
pub const SAMPLING_PARAMS: &[&str] = &[
    // OpenAI completions and chat completions
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "best_of",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "user",
    "stream",
    "stream_options",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    // vLLM / SGLang / llama.cpp sampling extensions
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "cache_prompt",
];

/// Parses one message body.
///
/// Errors: see [`ParseError`]; every error is final for that message (it is dead-lettered, never
/// retried). The request id (body `id`, else `message_id`) and `correlation_id` may have at most
/// [`MAX_ID_BYTES`] bytes and no control characters, `reply_to` at most
/// [`MAX_SHORT_STRING_BYTES`].
pub fn parse(body: &[u8], env: &Envelope<'_>, max_bytes: usize) -> Result<Request, ParseError> {
    if body.len() > max_bytes {
        return Err(ParseError::TooLarge { size: body.len(), limit: max_bytes });
    }
    check_length("reply_to", env.reply_to.unwrap_or_default(), MAX_SHORT_STRING_BYTES)?;
    let mut obj = json_object(body)?;
    // `null` counts as absent (as for `id`): serializers that write unset fields as null.
    let prompt = obj.remove("prompt").filter(|v| !v.is_null());
    let messages = obj.remove("messages").filter(|v| !v.is_null());
    let body = match (prompt, messages) {
        (Some(_), Some(_)) => return Err(ParseError::BothPromptAndMessages),
        (None, None) => return Err(ParseError::MissingPrompt),
        (Some(Value::String(p)), None) => Body::Completion(p),
        (Some(other), None) => {
            return Err(ParseError::InvalidField {
                field: "prompt",
                detail: format!("expected a string, got {}", json_type(&other)),
            })
        }
        (None, Some(m)) => Body::Chat(parse_messages(m)?),
    };
    let id = request_id(obj.remove("id"), env.message_id)?;
    // After the id: `submit` copies the id into `correlation_id`, so a bad id is named as such.
    check_length("correlation_id", env.correlation_id.unwrap_or_default(), MAX_ID_BYTES)?;
    check_no_control("correlation_id", env.correlation_id.unwrap_or_default())?;
    // The result's `x-reply-to` header and log lines carry `reply_to` too (a refused reply queue).
    check_no_control("reply_to", env.reply_to.unwrap_or_default())?;
    check_direct_reply_to(env.reply_to.unwrap_or_default())?;
    let model = model_field(obj.remove("model"))?;
    let params = params_field(obj.remove("params"))?;
    let prefix_key = prefix_key_field(obj.remove("prefix_key"), env)?;
    // What is left is ignored (room for publishers' own fields), except a sampling parameter
    // put at the top level instead of in `params`: ignoring it would run the request with the
    // server's default (`max_tokens` above all), silently.
    if let Some(name) = SAMPLING_PARAMS.iter().find(|n| obj.contains_key(**n)) {
        return Err(ParseError::InvalidField {
            field: name,
            detail: format!("is a sampling parameter: it goes in `params` (`{{\"params\": {{\"{name}\": …}}}}`); at the top level it would be ignored"),
        });
    }
    Ok(Request { id, body, model, params, prefix_key })
}

/// The body as UTF-8 JSON text (a leading byte order mark skipped) holding an object with no
/// duplicate keys ([`StrictJson`]).
fn json_object(body: &[u8]) -> Result<Map<String, Value>, ParseError> {
    let text = std::str::from_utf8(body).map_err(|e| ParseError::InvalidUtf8(e.to_string()))?;
    // RFC 8259 §8.1: a parser MAY ignore a leading byte order mark (some Windows tools write one).
    let text = text.strip_prefix('\u{FEFF}').unwrap_or(text);
    let StrictJson(value) = serde_json::from_str(text).map_err(|e| {
        let mut detail = e.to_string();
        if text.starts_with('\u{FEFF}') {
            detail.push_str(" (the body starts with another byte order mark, U+FEFF, after the one skipped)");
        }
        // serde_json's text for a lone UTF-16 surrogate escape (`"\ud800"`) names no surrogate.
        if detail.contains("hex escape") || detail.contains("surrogate") {
            detail.push_str(" (JSON strings hold Unicode text: a \\uD800–\\uDFFF escape must be half of a valid surrogate pair)");
        }
        ParseError::InvalidJson(detail)
    })?;
    let Value::Object(obj) = value else {
        return Err(ParseError::InvalidJson(format!("expected an object, got {}", json_type(&value))));
    };
    Ok(obj)
}

/// The `model` field: absent or null for the configured `llm.model`, else a non-empty string.
fn model_field(v: Option<Value>) -> Result<Option<String>, ParseError> {
    Ok(match v {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.is_empty() => {
            return Err(ParseError::InvalidField {
                field: "model",
                detail: "must not be empty (leave `model` out to use the configured llm.model)".into(),
            })
        }
        Some(Value::String(s)) => Some(s),
        Some(other) => {
            return Err(ParseError::InvalidField {
                field: "model",
                detail: format!("expected a string, got {}", json_type(&other)),
            })
        }
    })
}

/// The `params` field: absent or null for none, else an object.
fn params_field(v: Option<Value>) -> Result<Map<String, Value>, ParseError> {
    Ok(match v {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m,
        Some(other) => {
            return Err(ParseError::InvalidField {
                field: "params",
                detail: format!("expected an object, got {}", json_type(&other)),
            })
        }
    })
}

/// The explicit prefix key: the `prefix_key` field (a string), else the `x-prefix-key` header of
/// `env`; never empty.
fn prefix_key_field(v: Option<Value>, env: &Envelope<'_>) -> Result<Option<String>, ParseError> {
    let (prefix_key, key_field) = match v {
        None | Some(Value::Null) => match env.prefix_key_header_refused {
            Some(got) => {
                return Err(ParseError::InvalidField {
                    field: "x-prefix-key",
                    detail: format!("the header must be a string (or a byte array holding UTF-8), got {got}"),
                })
            }
            None => (env.prefix_key_header.map(str::to_owned), "x-prefix-key"),
        },
        Some(Value::String(s)) => (Some(s), "prefix_key"),
        Some(other) => {
            return Err(ParseError::InvalidField {
                field: "prefix_key",
                detail: format!("expected a string, got {}", json_type(&other)),
            })
        }
    };
    if prefix_key.as_deref() == Some("") {
        return Err(ParseError::InvalidField {
            field: key_field,
            detail: "is empty: every request with an empty key would share one; leave it out to key by the prompt".to_owned(),
        });
    }
    Ok(prefix_key)
}

/// The prefix of the names RabbitMQ gives direct reply-to requesters: a request published with
/// `reply_to = "amq.rabbitmq.reply-to"` reaches the daemon with `amq.rabbitmq.reply-to.<token>`
/// (<https://www.rabbitmq.com/docs/direct-reply-to>).
pub const DIRECT_REPLY_TO_PREFIX: &str = "amq.rabbitmq.reply-to.";

/// Refuses a `reply_to` that starts like a direct reply-to name ([`DIRECT_REPLY_TO_PREFIX`]) but
/// is not one RabbitMQ could have issued. RabbitMQ 3.10 decodes such a name when a message is
/// published to it (or it is declared passively) without catching errors (4.2 catches them), so a malformed one
/// crashes the publishing channel and RabbitMQ closes the whole connection with
/// `INTERNAL_ERROR` (observed on 3.10.8: `{case_clause, …}` in `pid_recomposition:from_binary`),
/// which would restart every partition of the instance at each delivery of that request.
///
/// The form RabbitMQ issues (`rabbit_direct_reply_to:compute_key_and_suffix_v2`, 3.10 and later;
/// `rabbit_volatile_queue:new_name`, 4.2): `amq.rabbitmq.reply-to.{pid}.{key}`, where `{key}` is
/// non-empty without a dot and `{pid}` is the standard, padded base64 of an Erlang external-term
/// pid: 131, `NEW_PID_EXT` (88) or `PID_EXT` (103), `ATOM_UTF8_EXT` (118, 16-bit length) or
/// `SMALL_ATOM_UTF8_EXT` (119, 8-bit length), a node name `{name}@{decimal node hash}` of at
/// most 255 characters, then 12 bytes (`NEW_PID_EXT`: id, serial, creation) or 9 (`PID_EXT`).
/// A name of this form whose requester is gone is harmless: RabbitMQ drops or returns the result.
fn check_direct_reply_to(reply_to: &str) -> Result<(), ParseError> {
    let Some(suffix) = reply_to.strip_prefix(DIRECT_REPLY_TO_PREFIX) else { return Ok(()) };
    let refuse = |why: &str| ParseError::InvalidField {
        field: "reply_to",
        detail: format!(
            "is not a direct reply-to name RabbitMQ issued ({why}): names starting with {DIRECT_REPLY_TO_PREFIX:?} must be taken unchanged from the reply_to RabbitMQ sets on a request published with reply_to \"amq.rabbitmq.reply-to\""
        ),
    };
    let Some((pid, key)) = suffix.split_once('.') else { return Err(refuse("no `.{key}` after the pid")) };
    if key.is_empty() || key.contains('.') || pid.is_empty() {
        return Err(refuse("not `{pid}.{key}`"));
    }
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD.decode(pid).map_err(|e| refuse(&format!("the pid is not base64: {e}")))?;
    check_encoded_pid(&bytes).map(|_| ()).map_err(|why| refuse(&format!("the pid {why}")))
}

/// The node (`{name}@{decimal hash}`) of a direct reply-to name of the form
/// `check_direct_reply_to` accepts; `None` for another `reply_to`.
pub fn direct_reply_to_node(reply_to: &str) -> Option<String> {
    use base64::Engine as _;
    let (pid, _) = reply_to.strip_prefix(DIRECT_REPLY_TO_PREFIX)?.split_once('.')?;
    let bytes = base64::engine::general_purpose::STANDARD.decode(pid).ok()?;
    check_encoded_pid(&bytes).ok().map(str::to_owned)
}

/// Checks the external-term encoding of a pid as [`check_direct_reply_to`] describes it; returns
/// its node name.
fn check_encoded_pid(b: &[u8]) -> Result<&str, &'static str> {
    let (tail_len, rest) = match b {
        [131, 88, rest @ ..] => (12, rest),
        [131, 103, rest @ ..] => (9, rest),
        _ => return Err("is not an encoded pid"),
    };
    let (len, rest) = match rest {
        [118, hi, lo, rest @ ..] => (usize::from(*hi) << 8 | usize::from(*lo), rest),
        [119, len, rest @ ..] => (usize::from(*len), rest),
        _ => return Err("has no node name"),
    };
    if rest.len() != len + tail_len {
        return Err("has the wrong length");
    }
    let node = std::str::from_utf8(&rest[..len]).map_err(|_| "has a node name that is not UTF-8")?;
    let (name, hash) = node.split_once('@').ok_or("has a node name without `@`")?;
    let hash_ok = !hash.is_empty() && hash.bytes().all(|c| c.is_ascii_digit());
    if name.is_empty() || !hash_ok || node.chars().count() > 255 {
        return Err("has a node name that is not `{name}@{decimal hash}`");
    }
    Ok(node)
}

/// The request id: the body's `id` (a non-empty string, or an integer from -2^63 to 2^64 − 1
/// written in decimal), else the AMQP `message_id`, else a generated UUID v4; at most
/// [`MAX_ID_BYTES`] bytes, and no control characters ([`check_no_control`]).
///
/// A number outside that range, or with a fraction or an exponent (`1e2`, `1.5`), is refused:
/// serde_json (like JavaScript's `JSON.parse`) reads it as an `f64`, which keeps 53 bits, so
/// distinct ids would collide (`123456789012345678901234567890` and `…891` both read as
/// `1.2345678901234568e29`).
fn request_id(body_id: Option<Value>, message_id: Option<&str>) -> Result<String, ParseError> {
    Ok(match body_id {
        Some(Value::String(s)) if !s.is_empty() => {
            check_length("id", &s, MAX_ID_BYTES)?;
            check_no_control("id", &s)?;
            s
        }
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => n.to_string(),
        Some(Value::Number(n)) => {
            return Err(ParseError::InvalidField {
                field: "id",
                detail: format!(
                    "a numeric id must be an integer from -2^63 to 2^64-1 without fraction or exponent; this one reads as the float {n}, and JSON parsers round such numbers, so two ids could become one: send it as a string"
                ),
            })
        }
        None | Some(Value::Null) => match message_id.filter(|s| !s.is_empty()) {
            Some(m) => {
                check_length("message_id", m, MAX_ID_BYTES)?;
                check_no_control("message_id", m)?;
                m.to_owned()
            }
            None => uuid::Uuid::new_v4().to_string(),
        },
        Some(other) => {
            let got = if other == Value::String(String::new()) { "an empty string" } else { json_type(&other) };
            return Err(ParseError::InvalidField { field: "id", detail: format!("expected a non-empty string or a number, got {got}") });
        }
    })
}

/// The request id of a body that [`parse`] refused, as far as it can be read: the body's `id`
/// when the body is a JSON object with a valid one, else a valid `message_id`; `None` when
/// neither (no id is generated for a refused request). For the dead letter's `x-request-id`.
pub fn refused_request_id(body: &[u8], err: &ParseError, message_id: Option<&str>) -> Option<String> {
    /// The `id` member of an object; every other member is skipped without being built
    /// (`IgnoredAny`), so a body over the size limit is scanned once, not held as a JSON tree.
    #[derive(serde::Deserialize)]
    struct IdOnly {
        #[serde(default)]
        id: Option<Value>,
    }
    let is_object = body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    let body_id = match err {
        // Not text: nothing to read.
        ParseError::InvalidUtf8(_) => None,
        _ if !is_object => None,
        _ => serde_json::from_slice::<IdOnly>(body).ok().and_then(|b| b.id),
    };
    if body_id.is_none() && message_id.is_none_or(str::is_empty) {
        return None;
    }
    request_id(body_id, message_id).ok()
}

/// Whether `c` is refused in ids and names copied into headers and log lines
/// (`check_no_control`): Unicode category Cc, U+2028, U+2029, the bidirectional formatting
/// characters of Unicode Standard Annex #9, and the invisible characters of [`is_invisible`].
pub fn is_control_like(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{061C}' | '\u{200E}' | '\u{200F}' | '\u{2028}' | '\u{2029}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
        || is_invisible(c)
}

/// Whether `c` is a character that shows as nothing and joins nothing: the soft hyphen U+00AD,
/// the Mongolian vowel separator U+180E, the zero-width space U+200B, the word joiner and
/// invisible operators U+2060–U+2064, and the zero-width no-break space (byte order mark)
/// U+FEFF. An id holding one reads as another id in log lines and headers (`a\u{200B}b` as
/// `ab`). The zero-width non-joiner and joiner (U+200C, U+200D) are allowed: they belong to the
/// spelling of several scripts and to emoji sequences.
pub fn is_invisible(c: char) -> bool {
    matches!(c, '\u{00AD}' | '\u{180E}' | '\u{200B}' | '\u{2060}'..='\u{2064}' | '\u{FEFF}')
}

/// A request id (likewise `correlation_id` and `reply_to`) may not hold control characters: it is copied into result headers and log
/// lines, where a line feed or an escape sequence would forge or garble them, and a
/// bidirectional override would make it read differently from what it is (CVE-2021-42574).
/// Refused: Unicode category Cc (U+0000–U+001F, U+007F–U+009F), the line and paragraph
/// separators U+2028 and U+2029, the bidirectional formatting characters of Unicode
/// Standard Annex #9 (U+061C, U+200E, U+200F, U+202A–U+202E, U+2066–U+2069), and the invisible
/// characters of [`is_invisible`], which make an id read as another.
fn check_no_control(field: &'static str, value: &str) -> Result<(), ParseError> {
    match value.chars().find(|c| is_control_like(*c)) {
        None => Ok(()),
        Some(c) => {
            let kind = if c.is_control() {
                "the control character"
            } else if matches!(c, '\u{2028}' | '\u{2029}') {
                "the line or paragraph separator"
            } else if is_invisible(c) {
                "the invisible character"
            } else {
                "the bidirectional formatting character"
            };
            Err(ParseError::InvalidField {
                field,
                detail: format!(
                    "contains {kind} U+{:04X}; ids, correlation_id and reply_to may not hold control characters, line separators, bidirectional formatting characters or invisible characters",
                    u32::from(c)
                ),
            })
        }
    }
}

fn parse_messages(v: Value) -> Result<Vec<ChatMessage>, ParseError> {
    let Value::Array(items) = v else {
        return Err(ParseError::UnknownMessageSchema(format!(
            "`messages` must be a list, got {}",
            json_type(&v)
        )));
    };
    if items.is_empty() {
        return Err(ParseError::EmptyMessages);
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, raw)| {
            let bad = |what: String| ParseError::UnknownMessageSchema(format!("messages[{i}]: {what}"));
            let Value::Object(m) = &raw else {
                return Err(bad(format!("expected an object, got {}", json_type(&raw))));
            };
            let role = match m.get("role") {
                Some(Value::String(r)) if CHAT_ROLES.contains(&r.as_str()) => r.clone(),
                Some(Value::String(r)) => return Err(bad(format!("unknown role {r:?}"))),
                _ => return Err(bad("missing string `role`".into())),
            };
            let text = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for (j, part) in parts.iter().enumerate() {
                        match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                            (Some("text"), Some(t)) => text.push_str(t),
                            _ => return Err(bad(format!("content[{j}] is not a {{type: \"text\", text}} part"))),
                        }
                    }
                    text
                }
                // An assistant turn that only calls tools carries `content: null` (OpenAI API).
                Some(Value::Null) | None if role == "assistant" && m.contains_key("tool_calls") => String::new(),
                Some(other) => {
                    return Err(bad(format!("`content` must be a string or a list of text parts, got {}", json_type(other))))
                }
                None => return Err(bad("missing `content`".into())),
            };
            Ok(ChatMessage { role, text, raw })
        })
        .collect()
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Token counts reported by the LLM server for one request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct Usage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.completion_tokens`.
    pub completion_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens` when the server reports it (vLLM, SGLang,
    /// llama.cpp's llama-server).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub cached_tokens: Option<u64>,
}

/// Per-stage latencies of one request, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct TimingsMs {
    /// From the publish time (header `timestamp_in_ms`, else the AMQP `timestamp`, whole seconds)
    /// to the moment the batcher received the request; 0 when the publisher set neither, or one
    /// ahead of this host's clock ([`crate::partition::publish_time_ms`]).
    pub queued: u64,
    /// Time the request waited in its batch buffer.
    pub batch_wait: u64,
    /// From its batch's flush to the LLM's answers: the call(s), their retries, and any wait for
    /// an available endpoint through an LLM outage; less `llm_wait`.
    pub llm: u64,
    /// Time its LLM call waited for one of the endpoint's `llm.max_concurrency` permits before
    /// it was sent (all attempts together): the daemon's own queueing in front of a busy server.
    /// 0 in a failed result. Absent in results of older versions (read as 0).
    #[serde(default)]
    pub llm_wait: u64,
}

/// The error object of a failed result.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct ResultError {
    /// Closed set: see [`crate::llm::ErrorKind`].
    pub kind: String,
    /// Human-readable detail.
    pub message: String,
}

/// One of several choices generated for one prompt (`n` > 1): the fields of the same names of
/// [`RequestResult`], for that choice.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct ResultChoice {
    /// Completion text (completions), or the assistant message object (chat).
    pub output: Value,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub finish_reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub logprobs: Option<Value>,
}

/// The result message published for every request (DESIGN §2).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct RequestResult {
    pub id: String,
    pub ok: bool,
    /// Completion text (completions), or the assistant message object (chat); `null` on failure.
    pub output: Value,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub finish_reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub model: Option<String>,
    /// The choice's `logprobs` exactly as the server returned it (asked for with `logprobs` /
    /// `top_logprobs` in `params`); absent when the server sent none or `null`.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub logprobs: Option<Value>,
    /// Every choice the server generated for this prompt, in `index` order, when it generated more
    /// than one (asked for with `n` > 1 in `params`); `output`, `finish_reason` and `logprobs`
    /// above are those of the first. Absent for one choice.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub choices: Option<Vec<ResultChoice>>,
    /// The prefix key as 16 lowercase hex digits.
    pub prefix_key: String,
    pub shard: u32,
    pub partition: u32,
    /// `{partition}-{epoch}-{sequence}`: unique per batch within a lease.
    pub batch_id: String,
    pub batch_size: usize,
    pub timings_ms: TimingsMs,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<ResultError>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(body: &str) -> Result<Request, ParseError> {
        parse(body.as_bytes(), &Envelope::default(), 1 << 20)
    }

    #[test]
    fn direct_reply_to_names_must_be_ones_rabbitmq_issues() {
        let env = |reply_to: &'static str| Envelope { reply_to: Some(reply_to), ..Envelope::default() };
        let body = br#"{"prompt": "hi"}"#;
        // Issued by RabbitMQ 3.10.8 and 4.2 (node "reply@{hash}"), and names that are not direct
        // reply-to names at all.
        for ok in [
            "amq.rabbitmq.reply-to.g1h2AA5yZXBseUA2ODc4MTMzNAAAcEoAAAAAaS8eQg==.+XcUtfbmSjGtgNrmdozD9w==",
            "amq.rabbitmq.reply-to",
            "amq.gen-Xa2_9",
            "replies",
        ] {
            assert!(parse(body, &env(ok), 1 << 20).is_ok(), "{ok}");
        }
        for (bad, why) in [
            // A real name's pid cut short by 3 characters: crashed RabbitMQ 3.10.8's channel.
            ("amq.rabbitmq.reply-to.g1h2AA5yZXBseUA0NjE3NzA1NQAAAAAAAAAB.+XcUtfbmSjGtgNrmdozD9w==", "wrong length"),
            ("amq.rabbitmq.reply-to.abc", "no `.{key}`"),
            ("amq.rabbitmq.reply-to.abc.", "not `{pid}.{key}`"),
            ("amq.rabbitmq.reply-to.a.b.c", "not `{pid}.{key}`"),
            ("amq.rabbitmq.reply-to.g1h2AA5!.key", "not base64"),
            ("amq.rabbitmq.reply-to.aGVsbG8=.key", "not an encoded pid"),
            // "reply@abcdefgh": the node hash is not a number.
            ("amq.rabbitmq.reply-to.g1h2AA5yZXBseUBhYmNkZWZnaAAAcEoAAAAAaS8eQg==.key", "decimal hash"),
        ] {
            let e = parse(body, &env(bad), 1 << 20).expect_err(bad);
            assert_eq!(e.reason(), "invalid_field", "{bad}");
            assert!(e.to_string().contains("`reply_to`") && e.to_string().contains(why), "{bad}: {e}");
            assert_eq!(direct_reply_to_node(bad), None, "{bad}");
        }
        let issued = "amq.rabbitmq.reply-to.g1h2AA5yZXBseUA2ODc4MTMzNAAAcEoAAAAAaS8eQg==.+XcUtfbmSjGtgNrmdozD9w==";
        assert_eq!(direct_reply_to_node(issued).as_deref(), Some("reply@68781334"));
        assert_eq!(direct_reply_to_node("replies"), None);
    }

    #[test]
    fn completions_request() {
        let r = p(r#"{"id":"a","prompt":"hi","model":"m","params":{"max_tokens":3,"cache_prompt":true}}"#).unwrap();
        assert_eq!(r.id, "a");
        assert_eq!(r.body, Body::Completion("hi".into()));
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(r.params["max_tokens"], 3);
        assert_eq!(r.params["cache_prompt"], true);
    }

    #[test]
    fn id_falls_back_to_message_id_then_uuid() {
        let env = Envelope { message_id: Some("mid"), prefix_key_header: Some("hk"), ..Envelope::default() };
        let r = parse(br#"{"prompt":"x"}"#, &env, 100).unwrap();
        assert_eq!(r.id, "mid");
        assert_eq!(r.prefix_key.as_deref(), Some("hk"));
        let r = p(r#"{"prompt":"x"}"#).unwrap();
        assert_eq!(r.id.len(), 36);
        assert_ne!(r.id, p(r#"{"prompt":"x"}"#).unwrap().id);
    }

    #[test]
    fn an_empty_or_mistyped_key_is_refused_and_a_byte_order_mark_is_skipped() {
        for (body, env, field) in [
            (r#"{"prompt":"x","prefix_key":""}"#, Envelope::default(), "prefix_key"),
            (r#"{"prompt":"x","model":""}"#, Envelope::default(), "model"),
            (r#"{"prompt":"x"}"#, Envelope { prefix_key_header: Some(""), ..Envelope::default() }, "x-prefix-key"),
            (r#"{"prompt":"x"}"#, Envelope { prefix_key_header_refused: Some("an integer"), ..Envelope::default() }, "x-prefix-key"),
        ] {
            match parse(body.as_bytes(), &env, 1000) {
                Err(ParseError::InvalidField { field: f, .. }) => assert_eq!(f, field, "{body} {env:?}"),
                other => panic!("{body} {env:?}: {other:?}"),
            }
        }
        // The body's key wins over a mistyped header, which is then not used.
        let env = Envelope { prefix_key_header_refused: Some("an integer"), ..Envelope::default() };
        assert_eq!(parse(br#"{"prompt":"x","prefix_key":"k"}"#, &env, 1000).unwrap().prefix_key.as_deref(), Some("k"));
        let r = parse("\u{FEFF}{\"id\":\"b\",\"prompt\":\"x\"}".as_bytes(), &Envelope::default(), 1000).unwrap();
        assert_eq!(r.id, "b");
        let twice = parse("\u{FEFF}\u{FEFF}{\"prompt\":\"x\"}".as_bytes(), &Envelope::default(), 1000).unwrap_err();
        assert!(twice.to_string().contains("another byte order mark"), "{twice}");
    }

    #[test]
    fn a_lone_surrogate_escape_is_named() {
        let e = parse(br#"{"prompt":"\ud800"}"#, &Envelope::default(), 1000).unwrap_err();
        assert!(e.to_string().contains("surrogate pair"), "{e}");
        let e = parse(br#"{"prompt":"\ud800x"}"#, &Envelope::default(), 1000).unwrap_err();
        assert!(e.to_string().contains("surrogate pair"), "{e}");
    }

    #[test]
    fn a_refused_body_keeps_the_id_it_carries() {
        let err = |b: &[u8]| parse(b, &Envelope::default(), 1000).unwrap_err();
        let list = err(b"[1]");
        assert_eq!(refused_request_id(b"[1]", &list, Some("mid")).as_deref(), Some("mid"));
        assert_eq!(refused_request_id(b"[1]", &list, None), None, "no id is made up");
        let body = br#"{"id":7,"prompt":5}"#;
        assert_eq!(refused_request_id(body, &err(body), Some("mid")).as_deref(), Some("7"), "the body's id first");
        let body = br#"{"id":"bad\u0007","prompt":"x"}"#;
        assert_eq!(refused_request_id(body, &err(body), Some("mid")), None, "an invalid id is not copied");
        // Over the size limit: the id is still read (observed: a 5 MB body with a valid id was
        // dead-lettered `too_large` without `x-request-id`).
        let big = format!(r#"{{"prompt":"{}","id":"big-1"}}"#, "x".repeat(5000));
        let too_large = err(big.as_bytes());
        assert_eq!(too_large.reason(), "too_large");
        assert_eq!(refused_request_id(big.as_bytes(), &too_large, None).as_deref(), Some("big-1"));
        assert_eq!(refused_request_id(b" [\"x\"]", &list, None), None, "a list is no object, whatever its first member");
    }

    #[test]
    fn an_empty_messages_list_is_named() {
        let e = parse(br#"{"messages":[]}"#, &Envelope::default(), 1000).unwrap_err();
        assert_eq!(e.reason(), "missing_prompt");
        assert!(e.to_string().contains("`messages` is an empty list"), "{e}");
    }

    #[test]
    fn body_prefix_key_wins_over_header() {
        let env = Envelope { prefix_key_header: Some("hk"), ..Envelope::default() };
        let r = parse(br#"{"prompt":"x","prefix_key":"bk"}"#, &env, 100).unwrap();
        assert_eq!(r.prefix_key.as_deref(), Some("bk"));
    }

    #[test]
    fn chat_request_with_text_parts() {
        let r = p(r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#).unwrap();
        let Body::Chat(m) = r.body else { panic!() };
        assert_eq!(m[1].text, "ab");
        assert_eq!(m[0].raw["content"], "S");
    }

    #[test]
    fn bad_inputs_have_stable_reasons() {
        let cases: &[(&[u8], &str)] = &[
            (b"{not json", "invalid_json"),
            (b"[1,2]", "invalid_json"),
            (b"{\"id\":\"x\"}", "missing_prompt"),
            (b"{\"prompt\":\"a\",\"messages\":[]}", "both_prompt_and_messages"),
            (b"{\"messages\":[{\"role\":\"user\",\"content\":{\"x\":1}}]}", "unknown_message_schema"),
            (b"{\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}", "unknown_message_schema"),
            (b"{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]}", "unknown_message_schema"),
            (b"{\"messages\":\"hello\"}", "unknown_message_schema"),
            (b"{\"prompt\":5}", "invalid_field"),
            (b"{\"prompt\":\"x\",\"params\":[1]}", "invalid_field"),
            (b"{\"prompt\":\"\xff\xfe\"}", "invalid_utf8"),
        ];
        for (body, reason) in cases {
            let err = parse(body, &Envelope::default(), 1000).unwrap_err();
            assert_eq!(err.reason(), *reason, "{}", String::from_utf8_lossy(body));
            assert!(DEAD_LETTER_REASONS.contains(&err.reason()));
        }
        let err = parse(&[b' '; 11], &Envelope::default(), 10).unwrap_err();
        assert_eq!(err.reason(), "too_large");
    }

    /// Observed: `{"prompt": null}` was `missing_prompt` (null as absent), but a null `prompt`
    /// beside `messages` (or a null `messages` beside `prompt`) was `both_prompt_and_messages`
    /// (null as present), refusing requests from serializers that write unset fields as null.
    #[test]
    fn a_null_prompt_or_messages_counts_as_absent() {
        let chat = p(r#"{"prompt":null,"messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        assert!(matches!(chat.body, Body::Chat(_)), "{:?}", chat.body);
        let completion = p(r#"{"prompt":"hi","messages":null}"#).unwrap();
        assert!(matches!(completion.body, Body::Completion(ref t) if t == "hi"), "{:?}", completion.body);
        for body in [r#"{"prompt":null}"#, r#"{"messages":null}"#, r#"{"prompt":null,"messages":null}"#] {
            assert_eq!(p(body).unwrap_err().reason(), "missing_prompt", "{body}");
        }
    }

    #[test]
    fn assistant_tool_call_without_content_is_accepted() {
        let r = p(r#"{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":null,"tool_calls":[]}]}"#);
        assert!(r.is_ok());
    }

    #[test]
    fn render_chat_truncates_by_chars() {
        let msgs = vec![ChatMessage { role: "user".into(), text: "héllo".into(), raw: Value::Null }];
        assert_eq!(render_chat(&msgs, usize::MAX), "<|user|>\nhéllo\n");
        assert_eq!(render_chat(&msgs, 11), "<|user|>\nhé");
    }

    #[test]
    fn ids_with_control_characters_and_empty_ids_are_refused() {
        for (body, mid, field, detail) in [
            (r#"{"id":"a\nINFO forged line","prompt":"hi"}"#, None, "id", "U+000A"),
            (r#"{"id":"bell\u0007","prompt":"hi"}"#, None, "id", "U+0007"),
            (r#"{"id":"nul\u0000","prompt":"hi"}"#, None, "id", "U+0000"),
            (r#"{"id":"c1\u009b","prompt":"hi"}"#, None, "id", "U+009B"),
            (r#"{"prompt":"hi"}"#, Some("mid\r"), "message_id", "U+000D"),
            (r#"{"id":"","prompt":"hi"}"#, None, "id", "got an empty string"),
            (r#"{"id":[1],"prompt":"hi"}"#, None, "id", "got a list"),
        ] {
            let env = Envelope { message_id: mid, ..Envelope::default() };
            let err = parse(body.as_bytes(), &env, 1000).unwrap_err();
            match &err {
                ParseError::InvalidField { field: f, detail: d } => assert!(*f == field && d.contains(detail), "{body}: {err}"),
                other => panic!("{body}: {other:?}"),
            }
        }
        // Other characters are fine: non-ASCII, emoji, spaces, quotes.
        for id in ["héllo wörld", "🦀-42", r#"a \"quoted\" id"#, r"no-break\u00a0space"] {
            let body = format!(r#"{{"id":"{id}","prompt":"hi"}}"#);
            assert!(p(&body).is_ok(), "{body}");
        }
        assert_eq!(p(r#"{"id":12345,"prompt":"hi"}"#).unwrap().id, "12345", "a number is an id too");
    }

    #[test]
    fn a_numeric_id_is_kept_exactly_or_refused() {
        // Integers across the whole 64-bit range keep every digit.
        for id in ["0", "-1", "9007199254740993", "18446744073709551615", "-9223372036854775808"] {
            let body = format!(r#"{{"id":{id},"prompt":"hi"}}"#);
            assert_eq!(p(&body).unwrap().id, id, "{body}");
        }
        // Observed: these became floats, and the first two the same id. Each is now refused,
        // with a reason that says what to do.
        for id in [
            "123456789012345678901234567890",
            "123456789012345678901234567891",
            "18446744073709551616",
            "-9223372036854775809",
            "1e2",
            "1.5",
            "100.0",
        ] {
            let body = format!(r#"{{"id":{id},"prompt":"hi"}}"#);
            match p(&body).unwrap_err() {
                ParseError::InvalidField { field: "id", detail } => {
                    assert!(detail.contains("-2^63 to 2^64-1") && detail.contains("as a string"), "{body}: {detail}")
                }
                other => panic!("{body}: {other:?}"),
            }
        }
    }

    /// Observed: `reply_to = "amq.gen-x\r2026-12-04T00:00:00Z  INFO FORGED: all good"` matched the
    /// default reply-to pattern (`.` takes CR, ESC, NUL, U+202E), and a refused reply queue
    /// wrote it raw into a WARN line and the result's `x-reply-to` header.
    #[test]
    fn a_reply_to_with_a_control_character_is_refused() {
        for reply in ["amq.gen-x\r2026-12-04T00:00:00Z  INFO FORGED", "amq.gen-\u{202E}evil", "amq.gen-\u{1b}[31mred", "amq.gen-\u{0}"] {
            let env = Envelope { reply_to: Some(reply), ..Envelope::default() };
            match parse(br#"{"id":"r","prompt":"hi"}"#, &env, 1000).unwrap_err() {
                ParseError::InvalidField { field: "reply_to", detail } => assert!(detail.contains("control character"), "{reply:?}: {detail}"),
                other => panic!("{reply:?}: {other:?}"),
            }
        }
        let env = Envelope { reply_to: Some("amq.gen-héllo"), ..Envelope::default() };
        assert!(parse(br#"{"prompt":"hi"}"#, &env, 1000).is_ok());
    }

    #[test]
    fn a_correlation_id_with_a_control_character_is_refused() {
        for cid in ["a\r\nX-Forged: 1", "tab\there", "nul\u{0}", "esc\u{1b}[31m", "c1\u{85}", "txt.\u{202E}exe", "a\u{2066}b", "ls\u{2028}x"] {
            let env = Envelope { correlation_id: Some(cid), ..Envelope::default() };
            match parse(br#"{"prompt":"hi"}"#, &env, 1000).unwrap_err() {
                ParseError::InvalidField { field: "correlation_id", detail } => {
                    assert!(detail.contains("control character"), "{cid:?}: {detail}")
                }
                other => panic!("{cid:?}: {other:?}"),
            }
        }
        let env = Envelope { correlation_id: Some("héllo 🦀 \"q\""), ..Envelope::default() };
        assert!(parse(br#"{"prompt":"hi"}"#, &env, 1000).is_ok());
        // Observed: an id with U+202E (right-to-left override) was accepted, and read backwards
        // in every log line and header it was copied into.
        // The detail names the kind of character (it called U+2028 a control character).
        for (id, kind) in [
            (r#""inv\u202Eexe.txt""#, "the bidirectional formatting character U+202E"),
            (r#""a\u200Fb""#, "the bidirectional formatting character U+200F"),
            (r#""p\u2029q""#, "the line or paragraph separator U+2029"),
            (r#""bell\u0007""#, "the control character U+0007"),
            // Observed: these were accepted, and read as `ab` in log lines and headers.
            (r#""a\u200Bb""#, "the invisible character U+200B"),
            (r#""\uFEFFab""#, "the invisible character U+FEFF"),
            (r#""a\u00ADb""#, "the invisible character U+00AD"),
        ] {
            match p(&format!(r#"{{"id":{id},"prompt":"hi"}}"#)).unwrap_err() {
                ParseError::InvalidField { field: "id", detail } => assert!(detail.contains(kind), "{id}: {detail}"),
                other => panic!("{id}: {other:?}"),
            }
        }
        assert!(p(r#"{"id":"emoji 👩\u200D💻 zwj","prompt":"hi"}"#).is_ok(), "a zero-width joiner is not a control");
        // `submit` copies the id into `correlation_id`: the id is named, not its copy.
        let env = Envelope { correlation_id: Some("a\u{1}b"), ..Envelope::default() };
        match parse(br#"{"id":"a\u0001b","prompt":"hi"}"#, &env, 1000).unwrap_err() {
            ParseError::InvalidField { field, .. } => assert_eq!(field, "id"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_sampling_parameter_at_the_top_level_is_refused_other_fields_are_ignored() {
        for name in ["max_tokens", "temperature", "stop", "seed"] {
            let body = format!(r#"{{"prompt":"hi","{name}":8}}"#);
            let err = p(&body).unwrap_err();
            match &err {
                ParseError::InvalidField { field, detail } => assert!(*field == name && detail.contains("goes in `params`"), "{err}"),
                other => panic!("{body}: {other:?}"),
            }
        }
        let r = p(r#"{"prompt":"hi","metadata":{"team":"a"},"trace_id":"t-1","params":{"max_tokens":8}}"#).unwrap();
        assert_eq!(r.params.get("max_tokens"), Some(&serde_json::json!(8)));
    }

    #[test]
    fn ids_are_limited_to_max_id_bytes() {
        let body = |id: &str| format!(r#"{{"id":"{id}","prompt":"hi"}}"#);
        let at_limit = "a".repeat(MAX_ID_BYTES);
        assert_eq!(p(&body(&at_limit)).unwrap().id, at_limit);
        let err = p(&body(&"a".repeat(MAX_ID_BYTES + 1))).unwrap_err();
        assert_eq!(err.reason(), "invalid_field");
        assert!(matches!(&err, ParseError::InvalidField { field: "id", .. }), "{err:?}");
        assert!(err.to_string().contains("201 bytes") && err.to_string().contains("limit of 200"), "{err}");
        let long = "m".repeat(MAX_ID_BYTES + 1);
        let env = Envelope { message_id: Some(&long), ..Envelope::default() };
        let err = parse(br#"{"prompt":"x"}"#, &env, 100).unwrap_err();
        assert!(matches!(err, ParseError::InvalidField { field: "message_id", .. }), "{err:?}");
    }

    #[test]
    fn correlation_id_and_reply_to_are_limited() {
        let long = "c".repeat(MAX_ID_BYTES + 1);
        let env = Envelope { correlation_id: Some(&long), ..Envelope::default() };
        let err = parse(br#"{"prompt":"x"}"#, &env, 100).unwrap_err();
        assert!(matches!(err, ParseError::InvalidField { field: "correlation_id", .. }), "{err:?}");
        let queue = "q".repeat(MAX_SHORT_STRING_BYTES);
        let env = Envelope { correlation_id: Some(&long[..MAX_ID_BYTES]), reply_to: Some(&queue), ..Envelope::default() };
        assert!(parse(br#"{"prompt":"x"}"#, &env, 100).is_ok());
    }

    #[test]
    fn short_string_never_panics() {
        assert_eq!(short_string("id", "abc", MAX_ID_BYTES).unwrap().as_str(), "abc");
        let err = short_string("reply_to", &"x".repeat(300), 1000).unwrap_err();
        assert!(matches!(err, ParseError::InvalidField { field: "reply_to", .. }), "{err:?}");
        assert!(short_string("id", &"x".repeat(256), usize::MAX).is_err());
    }

    #[test]
    fn every_reason_is_listed_once() {
        let mut seen = std::collections::HashSet::new();
        assert!(DEAD_LETTER_REASONS.iter().all(|r| seen.insert(*r)));
        assert!(DEAD_LETTER_REASONS.contains(&REASON_DELIVERY_LIMIT));
    }
}

/// Property-based fuzzing of [`parse`] (`PROPTEST_CASES` cases per target; `scripts/test` runs a
/// fixed number): whatever the bytes and properties, it returns, never panics, and what it accepts
/// keeps the contract's limits.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;
    use serde_json::{json, Value};

    use super::*;

    fn any_json() -> impl Strategy<Value = Value> {
        crate::fuzz_json::any_json(".{0,12}".boxed())
    }

    /// A request-shaped object: the contract's keys with values of any type, or well-formed ones.
    fn request_like() -> impl Strategy<Value = Value> {
        let message = (prop_oneof![Just("system"), Just("user"), Just("assistant"), Just("robot")], any_json(), ".{0,30}")
            .prop_map(|(role, content, text)| if text.len() % 2 == 0 { json!({"role": role, "content": text}) } else { json!({"role": role, "content": content}) });
        let key = |name: &'static str, good: BoxedStrategy<Value>| {
            prop::option::of(prop_oneof![good, any_json()]).prop_map(move |v| v.map(|v| (name, v)))
        };
        (
            key("prompt", ".{0,60}".prop_map(Value::String).boxed()),
            key("messages", prop::collection::vec(message, 0..5).prop_map(Value::Array).boxed()),
            key("id", prop_oneof![".{1,250}".prop_map(Value::String), any::<u32>().prop_map(|n| json!(n))].boxed()),
            key("model", "[a-z]{1,10}".prop_map(Value::String).boxed()),
            key("params", Just(json!({"max_tokens": 8, "temperature": 0})).boxed()),
            key("prefix_key", ".{0,20}".prop_map(Value::String).boxed()),
        )
            .prop_map(|(a, b, c, d, e, f)| Value::Object([a, b, c, d, e, f].into_iter().flatten().map(|(k, v)| (k.to_owned(), v)).collect()))
    }

    fn check_accepted(r: &Request) {
        assert!(!r.id.is_empty() && r.id.len() <= MAX_ID_BYTES, "id {:?}", r.id);
        assert!(!r.id.chars().any(char::is_control), "id {:?}", r.id);
        if let Body::Chat(msgs) = &r.body {
            assert!(!msgs.is_empty());
            assert!(msgs.iter().all(|m| CHAT_ROLES.contains(&m.role.as_str())));
        }
    }

    proptest! {
        #[test]
        fn fuzz_parse_arbitrary_bytes(body in prop::collection::vec(any::<u8>(), 0..512), mid in prop::option::of(".{0,300}"), reply in prop::option::of(".{0,300}")) {
            let env = Envelope { message_id: mid.as_deref(), reply_to: reply.as_deref(), ..Envelope::default() };
            if let Ok(r) = parse(&body, &env, 256) {
                prop_assert!(body.len() <= 256);
                check_accepted(&r);
            }
        }

        #[test]
        fn fuzz_parse_request_shaped_json(v in request_like(), mid in prop::option::of(".{0,300}"), corr in prop::option::of(".{0,300}")) {
            let body = serde_json::to_vec(&v).unwrap();
            let env = Envelope { message_id: mid.as_deref(), correlation_id: corr.as_deref(), ..Envelope::default() };
            match parse(&body, &env, usize::MAX) {
                Ok(r) => {
                    check_accepted(&r);
                    prop_assert!(corr.as_deref().unwrap_or_default().len() <= MAX_ID_BYTES);
                }
                Err(e) => prop_assert!(DEAD_LETTER_REASONS.contains(&e.reason())),
            }
        }
    }

    /// JSON nested far deeper than any request: refused as `invalid_json` by serde_json's
    /// recursion limit (128 levels), without exhausting the stack.
    #[test]
    fn deeply_nested_json_is_refused_without_a_stack_overflow() {
        let depth = 100_000;
        let body = format!("{{\"prompt\": \"hi\", \"params\": {{\"x\": {}{}}}}}", "[".repeat(depth), "]".repeat(depth));
        let err = parse(body.as_bytes(), &Envelope::default(), usize::MAX).unwrap_err();
        assert_eq!(err.reason(), "invalid_json", "{err}");
        assert!(err.to_string().contains("recursion limit"), "{err}");
    }

    /// A key given twice, at the top or nested, used to keep its last value silently (which
    /// `id` or `max_tokens` was meant cannot be known): now `invalid_json` naming the key.
    #[test]
    fn a_key_given_twice_is_refused_naming_it() {
        let p = |body: &str| parse(body.as_bytes(), &Envelope::default(), usize::MAX);
        for (body, key) in [
            (r#"{"id":"a","prompt":"x","id":"b"}"#, "\"id\""),
            (r#"{"prompt":"x","params":{"max_tokens":5,"max_tokens":50000}}"#, "\"max_tokens\""),
            (r#"{"messages":[{"role":"user","content":"a","role":"system"}]}"#, "\"role\""),
        ] {
            let err = p(body).unwrap_err();
            assert_eq!(err.reason(), "invalid_json", "{body}: {err}");
            assert!(err.to_string().contains(&format!("duplicate key {key}")), "{body}: {err}");
        }
        let long = "k".repeat(500);
        let err = p(&format!(r#"{{"prompt":"x","{long}":1,"{long}":2}}"#)).unwrap_err();
        assert!(err.to_string().len() < 200, "the key is shortened: {err}");
        // Numbers, nulls, nesting and escapes read as serde_json reads them.
        let r = p(r#"{"prompt":"a\u00e9","params":{"temperature":0.5,"n":1,"stop":null,"logit_bias":{"1":-1}}}"#).unwrap();
        assert_eq!(r.params["temperature"], serde_json::json!(0.5));
        assert_eq!(r.params["logit_bias"]["1"], serde_json::json!(-1));
        assert!(r.params["stop"].is_null());
        assert_eq!(r.body, Body::Completion("a\u{e9}".into()));
    }
}
