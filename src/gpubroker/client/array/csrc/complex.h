// Complex numbers of one precision: a struct C of two reals R (OpenCL C has no operator overloading, so the
// generated code calls these). Formulas follow C99 Annex G's where a plain one would lose an infinity.
typedef struct { R re; R im; } C;
FN C C_make(R re, R im) { C z; z.re = re; z.im = im; return z; }
FN C C_add(C a, C b) { return C_make(a.re + b.re, a.im + b.im); }
FN C C_sub(C a, C b) { return C_make(a.re - b.re, a.im - b.im); }
FN C C_mul(C a, C b) { return C_make(a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re); }
FN C C_div(C a, C b) {
  R r, d;
  if (fabs(b.re) >= fabs(b.im)) {
    if (b.re == (R)0 && b.im == (R)0) return C_make(a.re / fabs(b.re), a.im / fabs(b.re));
    r = b.im / b.re; d = b.re + b.im * r;
    return C_make((a.re + a.im * r) / d, (a.im - a.re * r) / d);
  }
  r = b.re / b.im; d = b.re * r + b.im;
  return C_make((a.re * r + a.im) / d, (a.im * r - a.re) / d);
}
FN C C_neg(C a) { return C_make(-a.re, -a.im); }
FN C C_conj(C a) { return C_make(a.re, -a.im); }
FN R C_abs(C a) { return hypot(a.re, a.im); }
FN int C_eq(C a, C b) { return a.re == b.re && a.im == b.im; }
FN int C_isnan(C a) { return isnan(a.re) || isnan(a.im); }
FN int C_isinf(C a) { return isinf(a.re) || isinf(a.im); }
FN int C_isfinite(C a) { return isfinite(a.re) && isfinite(a.im); }
FN C C_round(C a) { return C_make(rint(a.re), rint(a.im)); }
FN C C_square(C a) { return C_mul(a, a); }
FN C C_reciprocal(C a) { return C_div(C_make((R)1, (R)0), a); }
FN C C_sign(C a) {
  if (a.re == (R)0 && a.im == (R)0) return C_make((R)0, (R)0);
  R m = hypot(a.re, a.im);
  return C_make(a.re / m, a.im / m);
}
FN C C_exp(C a) {
  if (a.im == (R)0) return C_make(exp(a.re), a.im);
  if (isinf(a.re) && !isfinite(a.im)) return a.re < (R)0 ? C_make((R)0, (R)0) : C_make(a.re, (R)GB_NAN);
  R e = exp(a.re);
  return C_make(e * cos(a.im), e * sin(a.im));
}
FN C C_log(C a) { return C_make(log(hypot(a.re, a.im)), atan2(a.im, a.re)); }
FN C C_sqrt(C a) {
  if (a.re == (R)0 && a.im == (R)0) return C_make((R)0, a.im);
  if (isinf(a.im)) return C_make((R)GB_INF, a.im);
  if (isnan(a.re)) return C_make(a.re, a.re + a.im);
  if (isinf(a.re)) {
    if (a.re > (R)0) return C_make(a.re, isnan(a.im) ? a.im : copysign((R)0, a.im));
    return C_make(isnan(a.im) ? a.im : (R)0, copysign((R)GB_INF, a.im));
  }
  R t = sqrt((fabs(a.re) + hypot(a.re, a.im)) * (R)0.5);
  if (a.re >= (R)0) return C_make(t, a.im / (t + t));
  return C_make(fabs(a.im) / (t + t), copysign(t, a.im));
}
FN C C_expm1(C a) {
  if (a.re == (R)0 && a.im == (R)0) return C_make((R)0, a.im);
  if (a.im == (R)0) return C_make(expm1(a.re), a.im);
  if (isinf(a.re) && !isfinite(a.im)) return a.re < (R)0 ? C_make((R)-1, (R)0) : C_make(a.re, (R)GB_NAN);
  R e = expm1(a.re), s = sin((R)0.5 * a.im);
  return C_make(e * cos(a.im) - (R)2 * s * s, (e + (R)1) * sin(a.im));
}
FN C C_log1p(C a) {
  R x = a.re + (R)1;
  if (fabs(a.re) < (R)0.5 && fabs(a.im) < (R)0.5)
    return C_make((R)0.5 * log1p(a.re * (a.re + (R)2) + a.im * a.im), atan2(a.im, x));
  return C_log(C_make(x, a.im));
}
FN C C_log2(C a) { C l = C_log(a); return C_make(l.re * (R)1.442695040888963407359924681001892137,
                                                 l.im * (R)1.442695040888963407359924681001892137); }
FN C C_log10(C a) { C l = C_log(a); return C_make(l.re * (R)0.434294481903251827651128918916605082,
                                                  l.im * (R)0.434294481903251827651128918916605082); }
FN C C_pow(C a, C b) {
  if (b.re == (R)0 && b.im == (R)0) return C_make((R)1, (R)0);
  if (a.re == (R)0 && a.im == (R)0) {
    if (b.im == (R)0 && b.re > (R)0) return C_make((R)0, (R)0);
    return C_make((R)GB_NAN, (R)GB_NAN);
  }
  if (b.im == (R)0 && a.im == (R)0 && a.re > (R)0) return C_make(pow(a.re, b.re), (R)0);
  return C_exp(C_mul(b, C_log(a)));
}
FN C C_sinh(C a) {
  R x = a.re, y = a.im;
  if (isfinite(x) && isfinite(y)) {
    if (y == (R)0) return C_make(sinh(x), y);
    return C_make(sinh(x) * cos(y), cosh(x) * sin(y));
  }
  if (x == (R)0) return C_make(x, y - y);
  if (y == (R)0) return C_make(x, y);
  if (isinf(x)) return isfinite(y) ? C_make(x * cos(y), (R)GB_INF * sin(y)) : C_make(x, y - y);
  return C_make((x * x) * (y - y), (x + x) * (y - y));
}
FN C C_cosh(C a) {
  R x = a.re, y = a.im;
  if (isfinite(x) && isfinite(y)) {
    if (y == (R)0) return C_make(cosh(x), x * y);
    return C_make(cosh(x) * cos(y), sinh(x) * sin(y));
  }
  if (x == (R)0) return C_make(y - y, (R)0);
  if (y == (R)0) return C_make(x * x, copysign((R)0, x) * y);
  if (isinf(x)) return isfinite(y) ? C_make((R)GB_INF * cos(y), x * sin(y)) : C_make(x * x, x * (y - y));
  return C_make((x * x) * (y - y), (x + x) * (y - y));
}
FN C C_tanh(C a) {
  R x = a.re, y = a.im;
  if (isnan(x)) return C_make(x, y == (R)0 ? y : x);
  if (isinf(x)) return C_make(copysign((R)1, x), copysign((R)0, y));
  if (!isfinite(y)) return C_make(x == (R)0 ? x : y - y, y - y);
  if (fabs(x) > (R)20) return C_make(copysign((R)1, x), (R)4 * sin(y) * cos(y) * exp((R)-2 * fabs(x)));
  R d = cosh((R)2 * x) + cos((R)2 * y);
  return C_make(sinh((R)2 * x) / d, sin((R)2 * y) / d);
}
FN C C_sin(C a) { C s = C_sinh(C_make(-a.im, a.re)); return C_make(s.im, -s.re); }
FN C C_cos(C a) { return C_cosh(C_make(-a.im, a.re)); }
FN C C_tan(C a) { C t = C_tanh(C_make(-a.im, a.re)); return C_make(t.im, -t.re); }
FN C C_asinh(C a) {
  /* odd and conjugate-symmetric: computed for |x| + i|y|, then the signs restored */
  R ax = fabs(a.re), ay = fabs(a.im), re, im;
  if (isnan(ax)) { re = isinf(ay) ? (R)GB_INF : ax; im = ay == (R)0 ? ay : (R)GB_NAN; }
  else if (isnan(ay)) { re = isinf(ax) ? ax : ay; im = ay; }
  else if (isinf(ax) || isinf(ay)) {
    re = (R)GB_INF;
    im = isinf(ax) ? (isinf(ay) ? (R)GB_PI_4 : (R)0)
                   : (R)GB_PI_2;
  } else {
    C z = C_make(ax, ay);
    /* far out, asinh(z) = log(2z) to working precision, and z*z would overflow */
    C w = ax > (R)1e8 || ay > (R)1e8 ? C_log(z) : C_log(C_add(z, C_sqrt(C_add(C_mul(z, z), C_make((R)1, (R)0)))));
    re = ax > (R)1e8 || ay > (R)1e8 ? w.re + (R)GB_LN2 : w.re; im = w.im;
  }
  return C_make(copysign(re, a.re), copysign(im, a.im));
}
FN C C_asin(C a) { C s = C_asinh(C_make(-a.im, a.re)); return C_make(s.im, -s.re); }
FN C C_acosh(C a) {
  /* conjugate-symmetric: computed for x + i|y|, then the imaginary sign restored */
  R x = a.re, ay = fabs(a.im), re, im;
  if (isnan(x)) { re = isinf(ay) ? (R)GB_INF : x; im = x; }
  else if (isnan(ay)) { re = isinf(x) ? (R)GB_INF : ay; im = x == (R)0 ? (R)GB_PI_2 : ay; }
  else if (isinf(x)) {
    re = (R)GB_INF;
    im = isinf(ay) ? (x > (R)0 ? (R)GB_PI_4 : (R)(3 * GB_PI_4)) : (x > (R)0 ? (R)0 : (R)(2 * GB_PI_2));
  } else if (isinf(ay)) { re = (R)GB_INF; im = (R)GB_PI_2; }
  else {
    C z = C_make(x, ay);
    int far = fabs(x) > (R)1e8 || ay > (R)1e8;  /* acosh(z) = log(2z) to working precision */
    C w = far ? C_log(z)
              : C_log(C_add(z, C_mul(C_sqrt(C_add(z, C_make((R)1, (R)0))), C_sqrt(C_sub(z, C_make((R)1, (R)0))))));
    re = far ? w.re + (R)GB_LN2 : w.re; im = w.im;
  }
  return C_make(re, copysign(im, a.im));
}
FN C C_acos(C a) {
  /* acos(z) = -i acosh(z) in the upper half plane; conjugate-symmetric */
  C w = C_acosh(C_make(a.re, fabs(a.im)));
  R im = -w.re;
  return C_make(w.im, signbit(a.im) ? -im : im);
}
FN C C_atanh(C a) {
  /* odd and conjugate-symmetric: computed for |x| + i|y|, then the signs restored */
  R ax = fabs(a.re), ay = fabs(a.im), re, im;
  if (isnan(ax)) { re = isinf(ay) ? (R)0 : ax; im = isinf(ay) ? (R)GB_PI_2 : ax; }
  else if (isnan(ay)) { re = (isinf(ax) || ax == (R)0) ? (R)0 : ay; im = ay; }
  else if (isinf(ax) || isinf(ay)) { re = (R)0; im = (R)GB_PI_2; }
  else if (ax == (R)1 && ay == (R)0) { re = (R)GB_INF; im = (R)0; }
  else {
    C z = C_make(ax, ay);
    C l = C_sub(C_log1p(z), C_log1p(C_neg(z)));
    re = (R)0.5 * l.re; im = (R)0.5 * l.im;
  }
  return C_make(copysign(re, a.re), copysign(im, a.im));
}
FN C C_atan(C a) { C t = C_atanh(C_make(-a.im, a.re)); return C_make(t.im, -t.re); }
