//! Properties of the request fingerprint: equivalent spellings of one intent always match, and
//! any change of intent never does.

use axum_idempotency::{Fingerprint, Fingerprinter, canonical_json};
use http::request::Parts;
use proptest::prelude::*;

/// A JSON value as the test sees it: numbers are `[-]digits × 10^exp` with `digits` free of
/// leading and trailing zeros (or `"0"`), so every value has one representation here.
#[derive(Clone, Debug)]
enum Json {
    Null,
    Bool(bool),
    Number {
        negative: bool,
        digits: String,
        exp: i64,
    },
    String(String),
    Array(Vec<Json>),
    /// Member names are unique.
    Object(Vec<(String, Json)>),
}

fn number() -> impl Strategy<Value = Json> {
    let digits = prop_oneof![
        1 => Just("0".to_owned()),
        6 => "[1-9]([0-9]{0,12}[1-9])?",
        1 => "[1-9][0-9]{20,40}[1-9]",
    ];
    let exp = prop_oneof![8 => -12i64..12, 1 => -1_000_000_000_000i64..1_000_000_000_000];
    (any::<bool>(), digits, exp).prop_map(|(negative, digits, exp)| {
        if digits == "0" {
            Json::Number {
                negative: false,
                digits,
                exp: 0,
            }
        } else {
            Json::Number {
                negative,
                digits,
                exp,
            }
        }
    })
}

fn text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9 \"\\\\/~é😀\u{1}\u{1f}\n\t\u{7f}]{0,8}"
}

fn json() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        number(),
        text().prop_map(Json::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Json::Array),
            prop::collection::btree_map(text(), inner, 0..6)
                .prop_map(|m| Json::Object(m.into_iter().collect())),
        ]
    })
}

/// The canonical text the crate must produce, written from the model without any parsing.
fn model_canonical(v: &Json, out: &mut String) {
    match v {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Number {
            negative,
            digits,
            exp,
        } => {
            if *negative {
                out.push('-');
            }
            out.push_str(digits);
            if *exp != 0 {
                out.push_str(&format!("e{exp}"));
            }
        }
        Json::String(s) => model_string(s, out),
        Json::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                model_canonical(item, out);
            }
            out.push(']');
        }
        Json::Object(members) => {
            let mut sorted: Vec<_> = members.iter().collect();
            sorted.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push('{');
            for (i, (k, v)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                model_string(k, out);
                out.push(':');
                model_canonical(v, out);
            }
            out.push('}');
        }
    }
}

fn model_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A small deterministic generator for the spelling choices, seeded by proptest.
struct Choices(u64);

impl Choices {
    fn below(&mut self, n: u64) -> u64 {
        // xorshift64*: plenty for picking spellings.
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
    fn flip(&mut self) -> bool {
        self.below(2) == 0
    }
}

/// Writes `v` as JSON text with random member order, whitespace, escapes and number spellings.
fn spell(v: &Json, c: &mut Choices, out: &mut String) {
    match v {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Number {
            negative,
            digits,
            exp,
        } => spell_number(*negative, digits, *exp, c, out),
        Json::String(s) => spell_string(s, c, out),
        Json::Array(items) => {
            out.push('[');
            space(c, out);
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                    space(c, out);
                }
                spell(item, c, out);
                space(c, out);
            }
            out.push(']');
        }
        Json::Object(members) => {
            let mut order: Vec<&(String, Json)> = members.iter().collect();
            for i in (1..order.len()).rev() {
                let j = c.below(i as u64 + 1) as usize;
                order.swap(i, j);
            }
            out.push('{');
            space(c, out);
            for (i, (k, v)) in order.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                    space(c, out);
                }
                spell_string(k, c, out);
                space(c, out);
                out.push(':');
                space(c, out);
                spell(v, c, out);
                space(c, out);
            }
            out.push('}');
        }
    }
}

fn space(c: &mut Choices, out: &mut String) {
    out.push_str(["", "", " ", "\n", "\t", "\r\n  "][c.below(6) as usize]);
}

fn spell_number(negative: bool, digits: &str, exp: i64, c: &mut Choices, out: &mut String) {
    if digits == "0" {
        let zeros = ["0", "-0", "0.0", "0e5", "-0.00E-3", "0E+0", "0.000"];
        out.push_str(zeros[c.below(zeros.len() as u64) as usize]);
        return;
    }
    if negative {
        out.push('-');
    }
    // Value = significand × 10^-frac_len × 10^written_exp, where the significand is the digits
    // with extra trailing zeros and frac_len digits sit after the point.
    let extra_zeros = c.below(3) as usize;
    let significand = format!("{digits}{}", "0".repeat(extra_zeros));
    let frac_len = c.below(significand.len() as u64 + 3) as usize;
    if frac_len == 0 {
        out.push_str(&significand);
    } else if frac_len < significand.len() {
        let (int, frac) = significand.split_at(significand.len() - frac_len);
        out.push_str(int);
        out.push('.');
        out.push_str(frac);
    } else {
        out.push_str("0.");
        out.push_str(&"0".repeat(frac_len - significand.len()));
        out.push_str(&significand);
    }
    let written_exp = exp - extra_zeros as i64 + frac_len as i64;
    if written_exp != 0 || c.flip() {
        out.push(if c.flip() { 'e' } else { 'E' });
        if written_exp >= 0 && c.flip() {
            out.push('+');
        }
        out.push_str(&written_exp.to_string());
    }
}

fn spell_string(s: &str, c: &mut Choices, out: &mut String) {
    out.push('"');
    for ch in s.chars() {
        let must_escape = ch == '"' || ch == '\\' || (ch as u32) < 0x20;
        if !must_escape && c.below(3) != 0 {
            out.push(ch);
            continue;
        }
        let short = match ch {
            '"' => Some("\\\""),
            '\\' => Some("\\\\"),
            '/' => Some("\\/"),
            '\u{8}' => Some("\\b"),
            '\u{c}' => Some("\\f"),
            '\n' => Some("\\n"),
            '\r' => Some("\\r"),
            '\t' => Some("\\t"),
            _ => None,
        };
        match short {
            Some(esc) if c.flip() => out.push_str(esc),
            _ => {
                let mut units = [0u16; 2];
                for unit in ch.encode_utf16(&mut units) {
                    if c.flip() {
                        out.push_str(&format!("\\u{unit:04x}"));
                    } else {
                        out.push_str(&format!("\\u{unit:04X}"));
                    }
                }
            }
        }
    }
    out.push('"');
}

fn spelled(v: &Json, seed: u64) -> String {
    let mut out = String::new();
    let mut c = Choices(seed | 1);
    space(&mut c, &mut out);
    spell(v, &mut c, &mut out);
    space(&mut c, &mut out);
    out
}

fn canonical(v: &Json) -> String {
    let mut out = String::new();
    model_canonical(v, &mut out);
    out
}

fn json_request() -> Parts {
    http::Request::post("/orders")
        .header("content-type", "application/json")
        .body(())
        .unwrap()
        .into_parts()
        .0
}

fn fp(f: &Fingerprinter, body: &str) -> Fingerprint {
    f.fingerprint(&json_request(), body.as_bytes())
}

/// Changes the `n`-th leaf (counting empty containers as leaves) to a value that differs from
/// it; returns `true` once done.
fn change_leaf(v: &mut Json, n: &mut usize, how: u8) -> bool {
    match v {
        Json::Array(items) if !items.is_empty() => {
            items.iter_mut().any(|item| change_leaf(item, n, how))
        }
        Json::Object(members) if !members.is_empty() => members
            .iter_mut()
            .any(|(_, item)| change_leaf(item, n, how)),
        leaf => {
            if *n > 0 {
                *n -= 1;
                return false;
            }
            *leaf = changed(leaf, how);
            true
        }
    }
}

fn count_leaves(v: &Json) -> usize {
    match v {
        Json::Array(items) if !items.is_empty() => items.iter().map(count_leaves).sum(),
        Json::Object(members) if !members.is_empty() => {
            members.iter().map(|(_, item)| count_leaves(item)).sum()
        }
        _ => 1,
    }
}

fn changed(leaf: &Json, how: u8) -> Json {
    match leaf {
        Json::Null => Json::Bool(how.is_multiple_of(2)),
        Json::Bool(b) => {
            if how.is_multiple_of(2) {
                Json::Bool(!b)
            } else {
                Json::Null
            }
        }
        Json::Number {
            negative,
            digits,
            exp,
        } if digits == "0" => Json::Number {
            negative: *negative,
            digits: "1".to_owned(),
            exp: i64::from(how) - 8,
        },
        Json::Number {
            negative,
            digits,
            exp,
        } => match how % 3 {
            // The smallest step at the last digit: 12.5 → 12.6 (or 12.9 → 13).
            0 => {
                let (digits, exp) = increment(digits, *exp);
                Json::Number {
                    negative: *negative,
                    digits,
                    exp,
                }
            }
            // A digit beyond the last one: 12.5 → 12.51.
            1 => Json::Number {
                negative: *negative,
                digits: format!("{digits}1"),
                exp: exp - 1,
            },
            _ => Json::Number {
                negative: !negative,
                digits: digits.clone(),
                exp: *exp,
            },
        },
        Json::String(s) => {
            if how.is_multiple_of(2) {
                Json::String(format!("{s}x"))
            } else {
                Json::Number {
                    negative: false,
                    digits: "1".to_owned(),
                    exp: 0,
                }
            }
        }
        Json::Array(_) => Json::Array(vec![Json::Null]),
        Json::Object(_) => {
            if how.is_multiple_of(2) {
                Json::Object(vec![("a".to_owned(), Json::Null)])
            } else {
                Json::Array(Vec::new())
            }
        }
    }
}

/// `digits + 1` at the last digit, renormalised (trailing zeros move to the exponent).
fn increment(digits: &str, exp: i64) -> (String, i64) {
    let mut bytes = digits.as_bytes().to_vec();
    let mut i = bytes.len();
    loop {
        if i == 0 {
            bytes.insert(0, b'1');
            break;
        }
        i -= 1;
        if bytes[i] == b'9' {
            bytes[i] = b'0';
        } else {
            bytes[i] += 1;
            break;
        }
    }
    let mut exp = exp;
    while bytes.last() == Some(&b'0') {
        bytes.pop();
        exp += 1;
    }
    (String::from_utf8(bytes).unwrap(), exp)
}

fn pointer_escape(name: &str) -> String {
    name.replace('~', "~0").replace('/', "~1")
}

/// Picks an existing path in `v` by `choice`, returning its JSON Pointer, or `None` for a
/// value with no members or elements.
fn some_path(v: &Json, choice: &mut u64) -> Option<String> {
    let children: Vec<(String, &Json)> = match v {
        Json::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| (i.to_string(), item))
            .collect(),
        Json::Object(members) => members
            .iter()
            .map(|(k, item)| (pointer_escape(k), item))
            .collect(),
        _ => return None,
    };
    if children.is_empty() {
        return None;
    }
    let (token, child) = &children[(*choice % children.len() as u64) as usize];
    *choice /= children.len() as u64 + 1;
    let here = format!("/{token}");
    if (*choice).is_multiple_of(2) {
        return Some(here);
    }
    *choice /= 2;
    Some(match some_path(child, choice) {
        Some(rest) => format!("{here}{rest}"),
        None => here,
    })
}

/// Replaces the value at `pointer` (which exists in `v`) with `replacement`.
fn replace_at(v: &mut Json, tokens: &[String], replacement: &Json) {
    let Some((first, rest)) = tokens.split_first() else {
        *v = replacement.clone();
        return;
    };
    match v {
        Json::Array(items) => {
            let i: usize = first.parse().unwrap();
            replace_at(&mut items[i], rest, replacement);
        }
        Json::Object(members) => {
            let name = first.replace("~1", "/").replace("~0", "~");
            let member = members.iter_mut().find(|(k, _)| *k == name).unwrap();
            replace_at(&mut member.1, rest, replacement);
        }
        _ => unreachable!("the pointer exists"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn equivalent_spellings_have_the_canonical_form_and_one_fingerprint(
        v in json(), seed_a in any::<u64>(), seed_b in any::<u64>()
    ) {
        let (a, b) = (spelled(&v, seed_a), spelled(&v, seed_b));
        let expected = canonical(&v);
        prop_assert_eq!(
            canonical_json(a.as_bytes(), &[]).map(|c| String::from_utf8(c).unwrap()),
            Some(expected.clone()),
            "spelled as {}", a
        );
        let f = Fingerprinter::new();
        prop_assert_eq!(fp(&f, &a), fp(&f, &b), "{} vs {}", a, b);
        prop_assert_eq!(fp(&f, &a), fp(&f, &expected));
    }

    #[test]
    fn canonical_form_is_a_fixed_point(v in json(), seed in any::<u64>()) {
        let once = canonical_json(spelled(&v, seed).as_bytes(), &[]).unwrap();
        prop_assert_eq!(canonical_json(&once, &[]), Some(once));
    }

    #[test]
    fn changing_any_leaf_changes_the_fingerprint(
        v in json(), seed in any::<u64>(), leaf in any::<usize>(), how in 0u8..16
    ) {
        let mut changed = v.clone();
        let mut n = leaf % count_leaves(&v);
        prop_assert!(change_leaf(&mut changed, &mut n, how));
        let f = Fingerprinter::new();
        prop_assert_ne!(
            fp(&f, &spelled(&v, seed)),
            fp(&f, &spelled(&changed, seed ^ 0x5555)),
            "{} vs {}", canonical(&v), canonical(&changed)
        );
    }

    #[test]
    fn a_number_one_smallest_step_away_is_different(
        negative in any::<bool>(), digits in "[1-9]([0-9]{0,15}[1-9])?", exp in -20i64..20
    ) {
        let (up, up_exp) = increment(&digits, exp);
        let sign = if negative { "-" } else { "" };
        let a = format!("{sign}{digits}e{exp}");
        let b = format!("{sign}{up}e{up_exp}");
        let c = format!("{sign}{digits}1e{}", exp - 1);
        let a = canonical_json(a.as_bytes(), &[]).unwrap();
        prop_assert_ne!(&a, &canonical_json(b.as_bytes(), &[]).unwrap());
        prop_assert_ne!(&a, &canonical_json(c.as_bytes(), &[]).unwrap());
    }

    #[test]
    fn ignored_fields_never_matter(
        v in json(), choice in any::<u64>(), replacement in json(),
        seed_a in any::<u64>(), seed_b in any::<u64>()
    ) {
        let mut choice = choice;
        let Some(pointer) = some_path(&v, &mut choice) else {
            return Ok(());
        };
        let tokens: Vec<String> = pointer[1..].split('/').map(str::to_owned).collect();
        let mut other = v.clone();
        replace_at(&mut other, &tokens, &replacement);
        let f = Fingerprinter::new().ignore_json_fields([pointer.clone()]);
        prop_assert_eq!(
            fp(&f, &spelled(&v, seed_a)),
            fp(&f, &spelled(&other, seed_b)),
            "ignoring {}", pointer
        );
    }

    #[test]
    fn query_order_never_matters(
        pairs in prop::collection::vec("[a-z0-9%=+]{1,6}", 0..8), seed in any::<u64>()
    ) {
        let mut shuffled = pairs.clone();
        let mut c = Choices(seed | 1);
        for i in (1..shuffled.len()).rev() {
            shuffled.swap(i, c.below(i as u64 + 1) as usize);
        }
        let request = |pairs: &[String]| {
            let uri = format!("/orders?{}", pairs.join("&"));
            let parts = http::Request::post(uri).body(()).unwrap().into_parts().0;
            Fingerprinter::new().fingerprint(&parts, b"")
        };
        prop_assert_eq!(request(&pairs), request(&shuffled));
    }

    #[test]
    fn a_different_method_path_or_query_value_is_a_different_intent(
        m1 in "[A-Z]{1,8}", m2 in "[A-Z]{1,8}",
        p1 in "(/[a-z0-9]{0,4}){1,3}", p2 in "(/[a-z0-9]{0,4}){1,3}",
        q1 in "[a-z0-9]{0,4}", q2 in "[a-z0-9]{0,4}",
    ) {
        let f = Fingerprinter::new();
        let request = |m: &str, p: &str, q: &str| {
            let parts = http::Request::builder()
                .method(m)
                .uri(format!("{p}?k={q}"))
                .body(())
                .unwrap()
                .into_parts()
                .0;
            f.fingerprint(&parts, b"{}")
        };
        let base = request(&m1, &p1, &q1);
        prop_assert_eq!(base == request(&m2, &p1, &q1), m1 == m2);
        prop_assert_eq!(base == request(&m1, &p2, &q1), p1 == p2);
        prop_assert_eq!(base == request(&m1, &p1, &q2), q1 == q2);
    }

    #[test]
    fn a_json_body_under_another_content_type_is_a_different_intent(
        v in json(), seed in any::<u64>(),
        other in prop_oneof![
            Just("text/plain"),
            Just("application/octet-stream"),
            Just("application/x-www-form-urlencoded"),
            Just("application/problem+json"),
        ]
    ) {
        let body = spelled(&v, seed);
        let parts = http::Request::post("/orders")
            .header("content-type", other)
            .body(())
            .unwrap()
            .into_parts()
            .0;
        let f = Fingerprinter::new();
        prop_assert_ne!(f.fingerprint(&parts, body.as_bytes()), fp(&f, &body));
    }
}
