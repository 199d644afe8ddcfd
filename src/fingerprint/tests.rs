//! The fingerprint's contract: what counts as the same intent and what does not.

use super::*;
use http::Request;

fn parts(method: &str, uri: &str, headers: &[(&str, &str)]) -> Parts {
    let mut builder = Request::builder().method(method).uri(uri);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    builder.body(()).unwrap().into_parts().0
}

fn json_parts() -> Parts {
    parts("POST", "/orders", &[("content-type", "application/json")])
}

#[test]
fn a_verbatim_copy_matches_only_a_byte_identical_request() {
    let language = http::header::ACCEPT_LANGUAGE;
    let f = Fingerprinter::new().include_headers([language.clone()]);
    let headers = [
        ("content-type", "application/json"),
        ("accept-language", "fr"),
    ];
    let sent = parts("POST", "/orders/1?a=1&b=2", &headers);
    let body = br#"{"a":1}"#;
    let kept = f.verbatim(&sent, body).expect("a small body is kept");
    assert!(kept.matches(&f, &sent, body));
    let rebuilt = Fingerprinter::new().include_headers([language]);
    assert!(
        kept.matches(&rebuilt, &sent, body),
        "an equal configuration"
    );

    let json = ("content-type", "application/json");
    let other = |method, uri, headers: &[(&str, &str)], body: &[u8]| {
        kept.matches(&f, &parts(method, uri, headers), body)
    };
    assert!(!other("POST", "/orders/1?a=1&b=2", &headers, br#"{"a":2}"#));
    assert!(!other("PUT", "/orders/1?a=1&b=2", &headers, body));
    assert!(!other("POST", "/orders/2?a=1&b=2", &headers, body));
    assert!(!other("POST", "/orders/1", &headers, body));
    assert!(!other("POST", "/orders/1?a=1&b=3", &headers, body));
    assert!(!other("POST", "/orders/1?a=1&b=2", &[json], body));
    assert!(!other(
        "POST",
        "/orders/1?a=1&b=2",
        &[json, ("accept-language", "de")],
        body
    ));
    let twice = [json, ("accept-language", "fr"), ("accept-language", "fr")];
    assert!(!other("POST", "/orders/1?a=1&b=2", &twice, body));
    let text = [("content-type", "text/plain"), ("accept-language", "fr")];
    assert!(!other("POST", "/orders/1?a=1&b=2", &text, body));
    assert!(!other(
        "POST",
        "/orders/1?a=1&b=2",
        &[("accept-language", "fr")],
        body
    ));
    assert!(
        !kept.matches(&Fingerprinter::new(), &sent, body),
        "another configuration"
    );

    // The same intent spelled differently is left to the fingerprint.
    let spaced = br#"{ "a": 1 }"#;
    let reordered = parts("POST", "/orders/1?b=2&a=1", &headers);
    assert!(!kept.matches(&f, &sent, spaced));
    assert!(!kept.matches(&f, &reordered, body));
    assert_eq!(f.fingerprint(&sent, spaced), f.fingerprint(&sent, body));
    assert_eq!(f.fingerprint(&reordered, body), f.fingerprint(&sent, body));
}

#[test]
fn bodies_over_64_kib_are_not_kept_verbatim() {
    let f = Fingerprinter::new();
    let body = vec![b'x'; VERBATIM_MAX_BODY + 1];
    assert!(f.verbatim(&json_parts(), &body).is_none());
    let kept = f.verbatim(&json_parts(), &body[..VERBATIM_MAX_BODY]);
    assert!(kept.is_some_and(|kept| kept.weight() >= VERBATIM_MAX_BODY));
}

#[test]
fn hex_shows_the_digest_bytes() {
    let fp = Fingerprinter::new().fingerprint_value("op", b"{}");
    assert_eq!(fp.to_hex().len(), 64);
    assert_eq!(fp.to_hex(), hex::encode(fp.as_bytes()));
    assert_eq!(fp.to_string(), fp.to_hex());
    assert_eq!(format!("{fp:?}"), format!("Fingerprint({})", fp.to_hex()));
}

#[test]
fn json_types_with_parameters_and_suffixes_are_canonicalised() {
    let f = Fingerprinter::new();
    let base = f.fingerprint(&json_parts(), br#"{"a":1,"b":2}"#);
    for ct in ["Application/JSON; charset=utf-8", " application/json ;x=y"] {
        let p = parts("POST", "/orders", &[("content-type", ct)]);
        assert_eq!(f.fingerprint(&p, br#"{"b":2, "a":1}"#), base, "{ct}");
    }
    let problem = parts(
        "POST",
        "/orders",
        &[("content-type", "application/problem+json")],
    );
    assert_eq!(
        f.fingerprint(&problem, br#"{"b":2,"a":1}"#),
        f.fingerprint(&problem, br#"{ "a":1, "b":2 }"#)
    );
}

#[test]
fn non_json_bodies_are_compared_as_raw_bytes() {
    let f = Fingerprinter::new();
    let text = parts("POST", "/orders", &[("content-type", "text/plain")]);
    assert_ne!(
        f.fingerprint(&text, br#"{"a":1,"b":2}"#),
        f.fingerprint(&text, br#"{"b":2,"a":1}"#)
    );
    let none = parts("POST", "/orders", &[]);
    assert_ne!(
        f.fingerprint(&none, b"{\"a\":1}"),
        f.fingerprint(&none, b"{ \"a\":1}")
    );
    assert_eq!(f.fingerprint(&none, b"abc"), f.fingerprint(&none, b"abc"));
}

#[test]
fn invalid_json_never_equals_a_canonical_form() {
    let f = Fingerprinter::new();
    // `{"a":1,"a":1}` is refused (duplicate); its raw bytes must not collide with anything
    // canonical, including the canonical text of the same bytes.
    let canonical_text = br#"{"a":1}"#;
    assert_ne!(
        f.fingerprint(&json_parts(), br#"{"a":1,"a":1}"#),
        f.fingerprint(&json_parts(), canonical_text)
    );
    assert_ne!(
        f.fingerprint(&json_parts(), b"{not json"),
        f.fingerprint(
            &parts("POST", "/orders", &[("content-type", "application/json")]),
            b"{not json "
        )
    );
}

#[test]
fn form_bodies_ignore_pair_order() {
    let f = Fingerprinter::new();
    let form = parts(
        "POST",
        "/orders",
        &[("content-type", "application/x-www-form-urlencoded")],
    );
    assert_eq!(
        f.fingerprint(&form, b"b=2&a=1"),
        f.fingerprint(&form, b"a=1&&b=2&")
    );
    assert_ne!(
        f.fingerprint(&form, b"a=1&b=2"),
        f.fingerprint(&form, b"a=1&b=3")
    );
    assert_ne!(f.fingerprint(&form, b"a=%20"), f.fingerprint(&form, b"a=+"));
}

#[test]
fn empty_body_is_its_own_case() {
    let f = Fingerprinter::new();
    let raw = parts("POST", "/orders", &[]);
    assert_ne!(f.fingerprint(&raw, b""), f.fingerprint(&raw, b" "));
    let form = parts(
        "POST",
        "/orders",
        &[("content-type", "application/x-www-form-urlencoded")],
    );
    assert_ne!(f.fingerprint(&form, b""), f.fingerprint(&form, b"&"));
    assert_ne!(
        f.fingerprint(&json_parts(), b""),
        f.fingerprint(&json_parts(), b" ")
    );
}

#[test]
fn content_type_is_part_of_the_intent() {
    let f = Fingerprinter::new();
    let a = parts("POST", "/orders", &[("content-type", "text/plain")]);
    let b = parts(
        "POST",
        "/orders",
        &[("content-type", "application/octet-stream")],
    );
    let c = parts("POST", "/orders", &[]);
    let fa = f.fingerprint(&a, b"x");
    assert_ne!(fa, f.fingerprint(&b, b"x"));
    assert_ne!(fa, f.fingerprint(&c, b"x"));
}

#[test]
fn included_headers_join_and_absence_differs_from_empty() {
    let f = Fingerprinter::new().include_headers([HeaderName::from_static("x-tenant")]);
    let body = b"{}";
    let none = f.fingerprint(&parts("POST", "/o", &[]), body);
    let empty = f.fingerprint(&parts("POST", "/o", &[("x-tenant", "")]), body);
    let a = f.fingerprint(&parts("POST", "/o", &[("x-tenant", "a")]), body);
    let b = f.fingerprint(&parts("POST", "/o", &[("x-tenant", "b")]), body);
    let ab = f.fingerprint(
        &parts("POST", "/o", &[("x-tenant", "a"), ("x-tenant", "b")]),
        body,
    );
    let ba = f.fingerprint(
        &parts("POST", "/o", &[("x-tenant", "b"), ("x-tenant", "a")]),
        body,
    );
    let all = [none, empty, a, b, ab, ba];
    for (i, x) in all.iter().enumerate() {
        for y in &all[i + 1..] {
            assert_ne!(x, y);
        }
    }
}

#[test]
fn headers_not_included_do_not_matter() {
    let f = Fingerprinter::new();
    assert_eq!(
        f.fingerprint(&parts("POST", "/o", &[("x-trace", "1")]), b"x"),
        f.fingerprint(&parts("POST", "/o", &[("x-trace", "2")]), b"x")
    );
}

#[test]
fn header_configuration_order_does_not_matter() {
    let (a, b) = (
        HeaderName::from_static("x-a"),
        HeaderName::from_static("x-b"),
    );
    let one = Fingerprinter::new().include_headers([a.clone(), b.clone()]);
    let two = Fingerprinter::new()
        .include_headers([b, a.clone()])
        .include_headers([a]);
    let p = parts("POST", "/o", &[("x-a", "1"), ("x-b", "2")]);
    assert_eq!(one.fingerprint(&p, b""), two.fingerprint(&p, b""));
}

#[test]
fn job_fingerprints_canonicalise_and_never_equal_http_ones() {
    let f = Fingerprinter::new().ignore_json_fields(["trace_id"]);
    let job = f.fingerprint_value("charge", br#"{"amount":1.50,"trace_id":1}"#);
    assert_eq!(
        job,
        f.fingerprint_value("charge", br#"{ "amount": 15e-1 }"#)
    );
    assert_ne!(job, f.fingerprint_value("refund", br#"{"amount":1.5}"#));
    assert_ne!(
        f.fingerprint_value("op", b"not json"),
        f.fingerprint_value("op", b"not json ")
    );
    let p = parts("charge", "/", &[("content-type", "application/json")]);
    assert_ne!(f.fingerprint(&p, br#"{"amount":1.5}"#), job);
}

#[test]
fn query_is_normalised_but_values_count() {
    let f = Fingerprinter::new();
    let fp = |uri: &str| f.fingerprint(&parts("POST", uri, &[]), b"");
    assert_eq!(fp("/o?b=2&a=1"), fp("/o?a=1&b=2"));
    assert_eq!(fp("/o?a=1&&b=2&"), fp("/o?a=1&b=2"));
    assert_eq!(fp("/o"), fp("/o?"));
    assert_ne!(fp("/o?a=1"), fp("/o?a=2"));
    assert_ne!(fp("/o?a=1"), fp("/o"));
    assert_ne!(fp("/o?a=%41"), fp("/o?a=A"));
    // Fields are length-prefixed, so bytes cannot move between pairs or into the path.
    assert_ne!(fp("/o?ab&c"), fp("/o?a&bc"));
}

#[test]
fn method_and_path_count() {
    let f = Fingerprinter::new();
    let body = br#"{"a":1}"#;
    let base = f.fingerprint(&json_parts(), body);
    assert_ne!(
        base,
        f.fingerprint(
            &parts("PATCH", "/orders", &[("content-type", "application/json")]),
            body
        )
    );
    assert_ne!(
        base,
        f.fingerprint(
            &parts("POST", "/orders/1", &[("content-type", "application/json")]),
            body
        )
    );
}
